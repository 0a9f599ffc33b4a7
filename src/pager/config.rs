//! What a pager is configured with: the settings a user chooses ([`PagerConfig`]), the
//! tuning knobs that only tests and benchmarks move ([`Tuning`]), and the options of one
//! release or resume.

use crate::backend::Mover;
use crate::backup::file;
use crate::pump::{self, PumpConfig};

use super::settings::PagerConfig;
use crate::error::{Error, Result};

/// Default physical chunk size: 512 MiB. Mapping costs per handle, so large chunks map
/// fast, and a region's last chunk wastes at most one chunk's rounding.
pub const DEFAULT_CHUNK_BYTES: usize = 512 << 20;

/// The longest tag, in bytes: tags are names, and a bounded length bounds the cost of the
/// "did you mean" of an unknown tag.
pub const MAX_TAG_BYTES: usize = 256;

/// Default buffer alignment: 256 bytes, what CUDA's own allocators guarantee.
pub const DEFAULT_ALIGN: usize = 256;

/// The 32-bit pattern of [`PagerConfig::poison_discards`]: `0x7FFF` in each 16-bit half is
/// a NaN in bf16 and in fp16, and the whole word a NaN in fp32.
pub const POISON: u32 = 0x7FFF_7FFF;

/// The environment variable that turns [`PagerConfig::poison_discards`] on for the pagers
/// of the registry ([`crate::Pager::for_device`]): `1`, `true` or `yes`.
pub const POISON_DISCARDS_ENV: &str = "GPU_PAGER_POISON_DISCARDS";

/// The environment variable that sets [`PagerConfig::host_budget_bytes`] for the pagers of
/// the registry ([`crate::Pager::for_device`]): a byte count such as `64G`.
pub const HOST_BUDGET_ENV: &str = "GPU_PAGER_HOST_BUDGET";

/// The environment variable that turns [`PagerConfig::prepin`] on for the pagers of the
/// registry ([`crate::Pager::for_device`]): `1`, `true` or `yes`.
pub const PREPIN_ENV: &str = "GPU_PAGER_PREPIN";

/// The environment variable that sets [`Tuning::reclaim_scrubbed`] for the pagers of the
/// registry ([`crate::Pager::for_device`]): `1`, `true` or `yes` turns it on, `0`, `false`
/// or `no` off; unset or blank leaves the configured setting (anything else is an error).
pub const RECLAIM_SCRUBBED_ENV: &str = "GPU_PAGER_RECLAIM_SCRUBBED";

/// Tuning knobs: each default is the measured best, and changing one trades speed, memory or
/// the number of driver calls; tests and benchmarks move them to reach edge cases. Not part
/// of the stable API.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    /// Physical chunk size of `Discard` and `DiscardZeroed` regions that are not elastic
    /// (for a growing one, the largest piece one buffer is mapped in), rounded as
    /// `chunk_bytes` (default 2 GiB: their resume copies nothing, so the fewest handles map
    /// fastest; `usize::MAX`: one handle per region or buffer). Elastic regions, mapped and
    /// trimmed chunk by chunk, keep `chunk_bytes`.
    pub discard_chunk_bytes: usize,
    /// Hash-chunk size in bytes for `skip_unchanged` and `verify_restore` (a multiple of
    /// 16; default 32 MiB).
    pub hash_chunk_bytes: usize,
    /// On resume, map `Preserve` regions in groups of doubling size, ahead on a helper
    /// thread, and copy each group as soon as it is mapped (default on). Off: map the whole
    /// region with one call, then copy.
    pub overlap_restore: bool,
    /// Bytes per unit of a pumped copy (default 256 MiB, about 5 ms over the link: smaller
    /// units restore no faster and cost more fences; rounded up to a multiple of 4 KiB).
    pub copy_unit_bytes: usize,
    /// Units' worth of bytes queued per mover at most (default 2: one copying, one ready
    /// behind it). What is in flight is all that a concurrent release of another tag waits
    /// for.
    pub copy_depth: usize,
    /// The mover [`crate::Pager::resume_on`] enqueues its restore with on the caller's
    /// stream (default [`Mover::CopyEngine`]; [`Mover::CopyKernel`] launches the copy kernel
    /// there).
    pub stream_mover: Mover,
    /// On release, a gap of fewer than this many bytes between two spans that a `Preserve`
    /// region saves (bytes marked overwritten, see [`crate::Pager::set_overwritten`], or
    /// free space between buffers) is copied along with them: one copy over a small gap
    /// costs less than two copies. Those bytes are then restored too, which their undefined
    /// contents allow. 0 copies exactly the unmarked bytes of live buffers. Default 1 MiB,
    /// which crosses the link in about the time one copy call's fixed cost takes.
    pub copy_gap_bytes: usize,
    /// On the first release of a `Preserve` region without a backup (no `prepin`), with
    /// `skip_unchanged` on: pin the backup and copy the whole region (a growing region's
    /// whole buffers) into it in one pass, the pinning of later pieces overlapping the copy
    /// of earlier ones, then hash it, so that the save that follows copies nothing (default
    /// on; [`crate::report::Steps::pin`] says what it counts). A backup holding bytes marked
    /// overwritten, which are never copied out, is pinned, then saved. Off: pin, then save.
    pub first_save_overlap: bool,
    /// Bytes per chunk of a file backup's transfers ([`crate::Medium::File`]): the pager
    /// pins a staging buffer of twice this size on the first file transfer, and one chunk
    /// crosses the link while the other is written to or read from the disk. Default
    /// 64 MiB: sequential disk I/O at full speed, a small staging buffer. Clamped to
    /// 4 KiB ..= [`crate::MAX_FILE_CHUNK_BYTES`].
    pub file_chunk_bytes: usize,
    /// After a release of device memory, collect the pages the driver scrubs on a helper
    /// thread, so that the next allocation (a resume's, a trainer's) does not wait for that
    /// bookkeeping ([`crate::backend::Backend::set_reclaim_scrubbed`]). Default on: it takes
    /// a 64 GiB KV resume through the drop-in from about 24 to about 5 ms, for a few 2 MiB
    /// allocations on a helper thread after each large release (BENCHMARKS.md).
    /// [`RECLAIM_SCRUBBED_ENV`] sets it for the registry's pagers.
    pub reclaim_scrubbed: bool,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            discard_chunk_bytes: 2 << 30,
            hash_chunk_bytes: crate::backup::DEFAULT_HASH_CHUNK_BYTES,
            overlap_restore: true,
            copy_unit_bytes: pump::DEFAULT_UNIT_BYTES,
            copy_depth: pump::DEFAULT_DEPTH,
            stream_mover: Mover::CopyEngine,
            copy_gap_bytes: 1 << 20,
            first_save_overlap: true,
            file_chunk_bytes: 64 << 20,
            reclaim_scrubbed: true,
        }
    }
}

impl PagerConfig {
    /// These settings with the environment applied: [`POISON_DISCARDS_ENV`] and
    /// [`PREPIN_ENV`] set to `1`, `true` or `yes` turn [`PagerConfig::poison_discards`] and
    /// [`PagerConfig::prepin`] on; [`HOST_BUDGET_ENV`] sets
    /// [`PagerConfig::host_budget_bytes`]; [`RECLAIM_SCRUBBED_ENV`] sets
    /// [`Tuning::reclaim_scrubbed`]. One rule for all: unset or blank leaves the setting,
    /// and a value that does not parse is [`Error::InvalidArgument`] naming the variable,
    /// its value and the forms it takes.
    pub fn with_env(self) -> Result<PagerConfig> {
        Ok(PagerConfig {
            poison_discards: self.poison_discards || env_switch(POISON_DISCARDS_ENV)? == Some(true),
            prepin: self.prepin || env_switch(PREPIN_ENV)? == Some(true),
            host_budget_bytes: env_bytes(HOST_BUDGET_ENV)?.unwrap_or(self.host_budget_bytes),
            tuning: Tuning {
                reclaim_scrubbed: env_switch(RECLAIM_SCRUBBED_ENV)?
                    .unwrap_or(self.tuning.reclaim_scrubbed),
                ..self.tuning
            },
            ..self
        })
    }

    /// The settings as a pager on a backend of granularity `g` applies them: sizes rounded
    /// and clamped as each field's docs say.
    pub(crate) fn effective(self, g: usize) -> PagerConfig {
        let t = self.tuning;
        let copies = PumpConfig {
            route: self.restore_route,
            unit_bytes: t.copy_unit_bytes,
            depth: t.copy_depth,
        }
        .normalized();
        PagerConfig {
            chunk_bytes: round_chunk(self.chunk_bytes, g),
            tuning: Tuning {
                discard_chunk_bytes: round_chunk(t.discard_chunk_bytes, g),
                hash_chunk_bytes: t
                    .hash_chunk_bytes
                    .max(16)
                    .checked_next_multiple_of(16)
                    .unwrap_or(usize::MAX / 16 * 16),
                copy_unit_bytes: copies.unit_bytes,
                copy_depth: copies.depth,
                file_chunk_bytes: file::clamp_chunk(t.file_chunk_bytes),
                ..t
            },
            ..self
        }
    }
}

/// Rounds a chunk size up to the granularity `g` and then to a power of two.
pub(crate) fn round_chunk(bytes: usize, g: usize) -> usize {
    let g = g.max(1);
    bytes
        .max(g)
        .div_ceil(g)
        .saturating_mul(g)
        .checked_next_power_of_two()
        .unwrap_or(usize::MAX / 2 + 1)
}

/// What a release does beyond backing up and unmapping ([`crate::Pager::release_with`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReleaseOptions {
    /// Tags (among those released) whose contents are dropped for this cycle instead of
    /// backed up: they come back zeroed at the next resume.
    pub drop: Vec<String>,
}

/// What a resume does beyond restoring ([`crate::Pager::resume_with`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResumeOptions {
    /// Keep the host memory of [`crate::Medium::Host`] backups after restoring from them,
    /// instead of giving it back (default: give it back). Kept, the next release of
    /// unchanged contents copies nothing; it is given back by the first resume without this.
    pub keep_host_backups: bool,
}

/// A byte-count environment variable (as the settings spell bytes, e.g. `64G`), if set; a
/// value that does not read as one is logged and left out.
fn env_bytes(name: &str) -> Result<Option<usize>> {
    env_value(
        name,
        crate::names::parse_bytes,
        "a byte count such as 64G, 512M or 1073741824",
    )
}

/// An on/off environment variable: `Some(true)` for `1`, `true` or `yes`, `Some(false)` for
/// `0`, `false` or `no` (any case, spaces trimmed), `None` when unset or empty.
fn env_switch(name: &str) -> Result<Option<bool>> {
    env_value(
        name,
        crate::names::parse_switch,
        "a switch: 1, true or yes turns it on, 0, false or no off",
    )
}

/// Environment variable `name` read by `parse`: `None` when unset or empty (blank), an
/// `InvalidArgument` naming the variable, its value and `forms` when it does not parse.
fn env_value<T>(name: &str, parse: impl Fn(&str) -> Option<T>, forms: &str) -> Result<Option<T>> {
    let Some(text) = std::env::var_os(name) else {
        return Ok(None);
    };
    let text = text.to_string_lossy();
    if text.trim().is_empty() {
        return Ok(None);
    }
    parse(&text).map(Some).ok_or_else(|| {
        Error::invalid(
            None,
            format!(
                "the environment variable {name}={} is not {forms}; fix or unset it",
                super::settings::quoted(&text)
            ),
        )
    })
}
