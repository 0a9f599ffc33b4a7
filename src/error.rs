//! The one error type of the crate. Every variant names the regions (tags) it concerns, when
//! it concerns any, and, in its message, what to do about it.
//!
//! Each message is complete: it includes the underlying backend or KV error, and
//! `source()` returns nothing, so that error-chain printers (anyhow, `log`, the C and
//! Python layers) show every cause exactly once.

use crate::backend::BackendError;

/// Result type of the pager.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong, as values. Nothing in the pager panics or exits on bad
/// input or driver failure.
///
/// The enum is deliberately exhaustive: [`Error::code`] maps every variant to a stable
/// [`ErrorCode`] inside this crate, and the C and Python layers take their codes and
/// exception classes from that one table, so a new variant cannot fall silently into a
/// catch-all arm elsewhere.
///
/// `Debug` shows the variant's name and the message (`NotResident: region `weights` is
/// released, …`), so that `fn main() -> Result<(), Error>`, `unwrap` and `{:?}` show the
/// tag and the fix as `Display` does; every field a variant holds is in its message.
#[derive(thiserror::Error)]
pub enum Error {
    /// The region is released; the operation needs it resident.
    #[error("region `{tag}` is released, so {op} cannot touch it; resume `{tag}` first")]
    NotResident {
        /// The region.
        tag: String,
        /// What was attempted.
        op: &'static str,
    },

    /// Pager access to a range of an elastic region that has no physical memory mapped
    /// (never backed, or trimmed). Nothing was touched.
    #[error(
        "{len} bytes at offset {offset} of elastic region `{tag}` have no physical memory; back \
         the bytes {offset}..{end} of `{tag}` first, or allocate KV blocks there",
        end = .offset + .len
    )]
    NotBacked {
        /// The region.
        tag: String,
        /// Start of the access, from the region's base.
        offset: usize,
        /// Length of the access.
        len: usize,
    },

    /// No region has this tag.
    #[error(
        "no region is tagged `{tag}`{}; create region `{tag}` first (with its policy and size)",
        did_you_mean(.nearest)
    )]
    UnknownTag {
        /// The tag asked for.
        tag: String,
        /// The existing tag closest to it (a likely typo), if any is close.
        nearest: Option<String>,
    },

    /// The region is held resident by leases and cannot be released now.
    #[error("region `{tag}` is held by {leases} lease(s); drop them before releasing it")]
    Busy {
        /// The region.
        tag: String,
        /// Live leases on it.
        leases: usize,
    },

    /// Mapping physical memory failed for lack of device memory: something else (a trainer,
    /// another region) holds it. Nothing was lost: a failed resume leaves the region
    /// released with its backup, a failed creation creates nothing, a failed back or
    /// allocation maps nothing new; a later call succeeds once the memory is free.
    #[error("{}", oom_message(.tag, .during, *.requested, *.free))]
    OutOfMemory {
        /// The region.
        tag: String,
        /// The step that needed the memory: `"resume"`, `"region creation"`, `"back"`, ...
        during: &'static str,
        /// Bytes the failing call asked the device for.
        requested: usize,
        /// Bytes the device had free at the failure.
        free: usize,
    },

    /// A size was zero, too large, or not acceptable here.
    #[error("invalid size for `{tag}`: {reason}")]
    InvalidSize {
        /// The region.
        tag: String,
        /// What is wrong and the accepted range.
        reason: String,
    },

    /// An access outside a buffer or region.
    #[error(
        "out of range in `{tag}`: {len} bytes at offset {offset} exceed the {size}-byte {what}"
    )]
    OutOfRange {
        /// The region.
        tag: String,
        /// `"buffer"` or `"region"`.
        what: &'static str,
        /// Start of the access.
        offset: usize,
        /// Length of the access.
        len: usize,
        /// Size of the buffer or region.
        size: usize,
    },

    /// The buffer is not (or no longer) allocated in its region.
    #[error(
        "buffer #{id} at offset {offset} of `{tag}` is not allocated (freed already, or from another pager); \
         free each buffer once"
    )]
    StaleBuffer {
        /// The region.
        tag: String,
        /// The buffer's id.
        id: u64,
        /// The buffer's offset.
        offset: usize,
    },

    /// The region has no free space large enough.
    #[error(
        "region `{tag}` has no free range of {requested} bytes (aligned to {align}); {free} bytes free \
         in all — create a larger region or free buffers"
    )]
    RegionFull {
        /// The region.
        tag: String,
        /// Bytes asked for.
        requested: usize,
        /// Alignment asked for.
        align: usize,
        /// Free bytes in the region (maybe fragmented).
        free: usize,
    },

    /// The tag exists with another policy, kind, size or backup medium.
    #[error(
        "region `{tag}` exists as {existing} but was asked for again as {requested}: they differ \
         in {differs}; ask with the same policy, size and options, remove the region first, or \
         use another tag"
    )]
    TagConflict {
        /// The region.
        tag: String,
        /// What it is.
        existing: String,
        /// What was asked for.
        requested: String,
        /// What differs, e.g. `"policy and size"`.
        differs: String,
    },

    /// Restored contents differ from what was backed up (`verify_restore` found it). The
    /// region was unmapped again and stays released with its backup.
    #[error(
        "restored contents of `{tag}` differ from its backup in the hash chunk at offset {offset}; \
         the region stays released — check for host memory errors or writes into the pinned backup"
    )]
    Corrupted {
        /// The region.
        tag: String,
        /// Byte offset of the first differing hash chunk.
        offset: usize,
    },

    /// The backup cannot be freed: the region is released and the backup holds its contents.
    #[error(
        "the backup of `{tag}` holds its contents while it is released; resume it before freeing the backup"
    )]
    BackupInUse {
        /// The region.
        tag: String,
    },

    /// An argument other than a size is not acceptable.
    #[error("invalid argument{}: {reason}", for_tag(.tag.as_deref()))]
    InvalidArgument {
        /// The region, when the argument concerns one.
        tag: Option<String>,
        /// What is wrong.
        reason: String,
    },

    /// A paged-KV-cache call was refused: a stale or foreign block id, an unknown sequence,
    /// exhaustion, a slot outside live blocks, bad lengths. Nothing was changed.
    #[error("KV cache{}: {error}", named(.tag.as_deref()))]
    Kv {
        /// The KV cache's region (none for a layout not yet tied to a region).
        tag: Option<String>,
        /// What is wrong, and what to do.
        error: crate::kernels::kv::KvError,
    },

    /// The device or the operating system failed.
    #[error("{op}{} failed: {error}", on_tags(.tags))]
    Backend {
        /// The regions the failed step was moving (none when it concerned no region; several
        /// when one driver call served a whole release or resume).
        tags: Vec<String>,
        /// What the pager was doing.
        op: &'static str,
        /// The backend's error.
        error: BackendError,
    },

    /// A companion of the region ([`crate::Companion`]) failed while it moved; the move was
    /// undone: the regions are as they were before the call, and the companions that had
    /// run were undone.
    #[error(
        "companion `{companion}` of region `{tag}` failed during the {phase}: {reason}; the \
         {phase} was undone (every region as before the call); fix what the companion \
         reports, or remove the companion, and call again"
    )]
    Companion {
        /// The region whose companion failed.
        tag: String,
        /// The companion's name.
        companion: String,
        /// `"release"` or `"resume"`.
        phase: &'static str,
        /// What the companion said.
        reason: String,
    },

    /// An invariant of gpu-pager itself failed: a bug, never the caller's input. The call
    /// changed nothing it could undo; please report it with the message.
    #[error(
        "internal error{}: {reason}; this is a bug in gpu-pager, please report it with this \
         message",
        for_tag(.tag.as_deref())
    )]
    Internal {
        /// The region the failed step concerned, if one.
        tag: Option<String>,
        /// Which invariant failed.
        reason: String,
    },
}

/// A KV error outside any cache (e.g. from [`crate::kv::KvLayout::new`]) as [`Error::Kv`]
/// without a tag, so that `?` works in functions returning [`Result`].
impl From<crate::kernels::kv::KvError> for Error {
    fn from(error: crate::kernels::kv::KvError) -> Self {
        Error::Kv { tag: None, error }
    }
}

/// A stable number per [`Error`] variant: the one source of the C library's error codes and
/// of the Python exception classes. Numbers are never reused or renumbered; `0` is success
/// in the C ABI and is not an `ErrorCode`.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ErrorCode {
    /// [`Error::NotResident`].
    NotResident = 1,
    /// [`Error::NotBacked`].
    NotBacked = 2,
    /// [`Error::UnknownTag`].
    UnknownTag = 3,
    /// [`Error::Busy`].
    Busy = 4,
    /// [`Error::OutOfMemory`].
    OutOfMemory = 5,
    /// [`Error::InvalidSize`].
    InvalidSize = 6,
    /// [`Error::OutOfRange`].
    OutOfRange = 7,
    /// [`Error::StaleBuffer`].
    StaleBuffer = 8,
    /// [`Error::RegionFull`].
    RegionFull = 9,
    /// [`Error::TagConflict`].
    TagConflict = 10,
    /// [`Error::Corrupted`].
    Corrupted = 11,
    /// [`Error::BackupInUse`].
    BackupInUse = 12,
    /// [`Error::InvalidArgument`].
    InvalidArgument = 13,
    /// [`Error::Kv`].
    Kv = 14,
    /// [`Error::Backend`].
    Backend = 15,
    /// [`Error::Internal`], and a backend's [`BackendError::Internal`].
    Internal = 16,
    /// [`Error::Companion`].
    Companion = 17,
    /// Not an [`Error`] variant: a foreign layer (C, Python) caught a panic inside
    /// gpu-pager at its boundary. Nothing was changed by the failed call as far as the
    /// pager can tell; it is a bug, please report it with the message.
    Panic = 99,
}

impl ErrorCode {
    /// Every code, in numeric order.
    pub const ALL: [ErrorCode; 18] = [
        ErrorCode::NotResident,
        ErrorCode::NotBacked,
        ErrorCode::UnknownTag,
        ErrorCode::Busy,
        ErrorCode::OutOfMemory,
        ErrorCode::InvalidSize,
        ErrorCode::OutOfRange,
        ErrorCode::StaleBuffer,
        ErrorCode::RegionFull,
        ErrorCode::TagConflict,
        ErrorCode::Corrupted,
        ErrorCode::BackupInUse,
        ErrorCode::InvalidArgument,
        ErrorCode::Kv,
        ErrorCode::Backend,
        ErrorCode::Internal,
        ErrorCode::Companion,
        ErrorCode::Panic,
    ];

    /// The number (as the C ABI returns it).
    pub fn number(self) -> u32 {
        self as u32
    }

    /// The code with this number, if any.
    pub fn from_number(n: u32) -> Option<ErrorCode> {
        ErrorCode::ALL.into_iter().find(|c| c.number() == n)
    }
}

/// The variant's name, e.g. `NotResident`: the C enumerator is `GPU_PAGER_ERROR_NOT_RESIDENT`
/// and the Python class `NotResidentError`.
impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {self}", self.code())
    }
}

impl Error {
    /// The [`Error::InvalidArgument`] for a range whose start lies past its end.
    pub(crate) fn reversed_range(tag: &str, range: &std::ops::Range<usize>) -> Error {
        Error::InvalidArgument {
            tag: Some(tag.to_string()),
            reason: format!(
                "the range {}..{} is reversed; pass start <= end",
                range.start, range.end
            ),
        }
    }

    /// The stable code of this error's variant (an exhaustive match: adding a variant
    /// without a code does not compile).
    pub fn code(&self) -> ErrorCode {
        match self {
            Error::NotResident { .. } => ErrorCode::NotResident,
            Error::NotBacked { .. } => ErrorCode::NotBacked,
            Error::UnknownTag { .. } => ErrorCode::UnknownTag,
            Error::Busy { .. } => ErrorCode::Busy,
            Error::OutOfMemory { .. } => ErrorCode::OutOfMemory,
            Error::InvalidSize { .. } => ErrorCode::InvalidSize,
            Error::OutOfRange { .. } => ErrorCode::OutOfRange,
            Error::StaleBuffer { .. } => ErrorCode::StaleBuffer,
            Error::RegionFull { .. } => ErrorCode::RegionFull,
            Error::TagConflict { .. } => ErrorCode::TagConflict,
            Error::Corrupted { .. } => ErrorCode::Corrupted,
            Error::BackupInUse { .. } => ErrorCode::BackupInUse,
            Error::InvalidArgument { .. } => ErrorCode::InvalidArgument,
            Error::Kv { .. } => ErrorCode::Kv,
            // Host memory that cannot be had is out-of-memory for every binding's user.
            Error::Backend {
                error: BackendError::HostOutOfMemory { .. } | BackendError::HostBudget { .. },
                ..
            } => ErrorCode::OutOfMemory,
            Error::Backend {
                error: BackendError::Internal { .. },
                ..
            } => ErrorCode::Internal,
            Error::Backend { .. } => ErrorCode::Backend,
            Error::Internal { .. } => ErrorCode::Internal,
            Error::Companion { .. } => ErrorCode::Companion,
        }
    }

    /// The region the error concerns: `None` when it concerns none (a bad argument to a
    /// call on no region, a driver that cannot be opened); the first of several (see
    /// [`Error::tags`]).
    pub fn tag(&self) -> Option<&str> {
        self.tags().first().copied()
    }

    /// Every region the error concerns: one for most errors, none or several for
    /// [`Error::Backend`] (a driver call that served a whole release or resume).
    pub fn tags(&self) -> Vec<&str> {
        match self {
            Error::NotResident { tag, .. }
            | Error::NotBacked { tag, .. }
            | Error::UnknownTag { tag, .. }
            | Error::Busy { tag, .. }
            | Error::OutOfMemory { tag, .. }
            | Error::InvalidSize { tag, .. }
            | Error::OutOfRange { tag, .. }
            | Error::StaleBuffer { tag, .. }
            | Error::RegionFull { tag, .. }
            | Error::TagConflict { tag, .. }
            | Error::Corrupted { tag, .. }
            | Error::BackupInUse { tag }
            | Error::Companion { tag, .. } => vec![tag.as_str()],
            Error::InvalidArgument { tag, .. }
            | Error::Kv { tag, .. }
            | Error::Internal { tag, .. } => tag.as_deref().into_iter().collect(),
            Error::Backend { tags, .. } => tags.iter().map(String::as_str).collect(),
        }
    }

    /// A [`Error::Backend`] for the backend failure `error` while doing `op` on `tag`.
    pub fn backend(tag: &str, op: &'static str, error: BackendError) -> Self {
        Error::backend_of(&[tag], op, error)
    }

    /// A [`Error::Backend`] for a step that served every region of `tags` (none: a step
    /// that concerned no region).
    pub fn backend_of(tags: &[&str], op: &'static str, error: BackendError) -> Self {
        Error::Backend {
            tags: tags.iter().map(|&t| t.to_owned()).collect(),
            op,
            error,
        }
    }

    /// An [`Error::InvalidArgument`] about `tag`'s region, or about no region.
    pub fn invalid(tag: Option<&str>, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            tag: tag.map(str::to_owned),
            reason: reason.into(),
        }
    }
}

/// `" for `tag`"`, or nothing for an error that concerns no region.
fn for_tag(tag: Option<&str>) -> String {
    tag.map_or_else(String::new, |t| format!(" for `{t}`"))
}

/// `" `tag`"`, or nothing.
fn named(tag: Option<&str>) -> String {
    tag.map_or_else(String::new, |t| format!(" `{t}`"))
}

/// `" on `a`"`, `" on `a`, `b`"`, or nothing for an error that concerns no region.
fn on_tags(tags: &[String]) -> String {
    if tags.is_empty() {
        return String::new();
    }
    let names: Vec<String> = tags.iter().map(|t| format!("`{t}`")).collect();
    format!(" on {}", names.join(", "))
}

/// `"; did you mean `x`?"` for [`Error::UnknownTag`], or nothing.
fn did_you_mean(nearest: &Option<String>) -> String {
    nearest
        .as_ref()
        .map_or_else(String::new, |n| format!(" (did you mean `{n}`?)"))
}

/// The message of [`Error::OutOfMemory`]: the advice depends on the step that failed.
fn oom_message(tag: &str, during: &str, requested: usize, free: usize) -> String {
    let lost = match during {
        "resume" => {
            "nothing was lost: the region stays released as it was (a Preserve region with \
             its backup), and a later resume succeeds once the memory is free"
        }
        "region creation" => "the region was not created",
        _ => "nothing new was mapped",
    };
    format!(
        "{during} of `{tag}` needs {requested} bytes of device memory but only {free} are free; \
         free memory held elsewhere (another process such as the trainer, or other regions: \
         release or trim them) and try again — {lost}"
    )
}

/// The existing tag nearest to `tag` by edit distance, if it is close enough to be a typo
/// (at most a third of the longer name's characters differ, ignoring case).
pub(crate) fn nearest_tag<'a>(
    tag: &str,
    known: impl IntoIterator<Item = &'a str>,
) -> Option<String> {
    let want = tag.to_lowercase();
    known
        .into_iter()
        .map(|k| {
            let have = k.to_lowercase();
            let len = want.chars().count().max(have.chars().count());
            (strsim::levenshtein(&want, &have), len, k)
        })
        .filter(|&(d, len, _)| d * 3 <= len)
        .min_by_key(|&(d, _, _)| d)
        .map(|(_, _, k)| k.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typos_find_their_tag() {
        let known = ["weights", "kv_cache", "cuda_graph"];
        assert_eq!(nearest_tag("weight", known).as_deref(), Some("weights"));
        assert_eq!(nearest_tag("kvcache", known).as_deref(), Some("kv_cache"));
        assert_eq!(nearest_tag("KV_CACHE", known).as_deref(), Some("kv_cache"));
        assert_eq!(nearest_tag("optimizer", known), None);
        assert_eq!(nearest_tag("w", known), None);
    }
}
