//! What a release or resume did: per region, the bytes and the time of each step.

use std::fmt;
use std::time::Duration;

use crate::backend::Mover;
use crate::pump::PumpStats;

/// Which move a report describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Move {
    /// Physical memory given back to the device.
    Release,
    /// Physical memory mapped again at the same addresses.
    Resume,
}

/// What happened to one region in a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The region changed state.
    Done,
    /// The region was already in the requested state; nothing was done.
    AlreadyDone,
}

/// Time spent in each step for one region.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Steps {
    /// Allocating the pinned host backup (first release only, unless prepinned). For the
    /// first release with [`crate::Tuning::first_save_overlap`], this includes copying
    /// into the backup what it pins (the whole region for a fixed one, the whole extent of
    /// each buffer whose backup is pinned for a growing one; the copy overlaps the pinning);
    /// that release's `copy` is then only what the save after it copied (nothing, unless
    /// the device changed in between).
    pub pin: Duration,
    /// Copying contents (device→host on release, host→device on resume). On resume, the
    /// part of the copy not hidden behind mapping.
    pub copy: Duration,
    /// Creating and mapping physical memory and enabling access. A resume that restores
    /// contents maps ahead on a helper thread while the copies run: there it is the time
    /// the resume waited for its mappings, not the time the map calls took.
    pub map: Duration,
    /// Unmapping and releasing physical memory.
    pub unmap: Duration,
    /// Filling on resume: zeros (a `DiscardZeroed` region, a dropped tag) or the poison of
    /// [`crate::PagerConfig::poison_discards`].
    pub fill: Duration,
    /// Hashing contents (release with `skip_unchanged`; resume with `verify_restore`).
    pub hash: Duration,
}

impl Steps {
    /// Sum of the steps.
    pub fn total(&self) -> Duration {
        self.pin + self.copy + self.map + self.unmap + self.fill + self.hash
    }
}

/// One region's part of a [`Report`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionReport {
    /// The region.
    pub tag: String,
    /// Whether it changed state.
    pub outcome: Outcome,
    /// Physical bytes mapped (resume) or unmapped (release).
    pub bytes: usize,
    /// Bytes copied between device and host: by the pump, and, on a first release with
    /// [`crate::Tuning::first_save_overlap`], while pinning (the whole region, or the
    /// extents of the growing region's buffers whose backups were pinned, timed in
    /// [`Steps::pin`]; [`Report::copies`] counts the pump's bytes only).
    pub copied: usize,
    /// Time per step.
    pub steps: Steps,
}

/// What one `release` or `resume` call did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// Release or resume.
    pub op: Move,
    /// Waiting for outstanding device work (release only).
    pub sync: Duration,
    /// One entry per region named in the call, in tag order.
    pub regions: Vec<RegionReport>,
    /// Wall time of the whole call.
    pub total: Duration,
    /// What the call's copy pump moved, per mover (the copy pump (`src/pump.rs`); all zero when nothing
    /// was copied, and for [`crate::Pager::resume_on`], which enqueues on the caller's
    /// stream instead).
    pub copies: PumpStats,
}

impl Report {
    /// Physical bytes moved in or out of the device's memory map.
    pub fn bytes(&self) -> usize {
        self.regions.iter().map(|r| r.bytes).sum()
    }

    /// Bytes copied between device and host.
    pub fn copied(&self) -> usize {
        self.regions.iter().map(|r| r.copied).sum()
    }

    /// The entry for `tag`, if the call named it.
    pub fn region(&self, tag: &str) -> Option<&RegionReport> {
        self.regions.iter().find(|r| r.tag == tag)
    }
}

/// Milliseconds of a duration, for printing.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A byte count for people: `"512 B"`, `"12.0 MiB"`, `"16.00 GiB"`.
pub fn bytes_h(bytes: usize) -> String {
    const KIB: f64 = 1024.0;
    let b = bytes as f64;
    if b < KIB {
        format!("{bytes} B")
    } else if b < KIB * KIB {
        format!("{:.1} KiB", b / KIB)
    } else if b < KIB * KIB * KIB {
        format!("{:.1} MiB", b / (KIB * KIB))
    } else {
        format!("{:.2} GiB", b / (KIB * KIB * KIB))
    }
}

/// Gigabytes per second (10^9 bytes) for `bytes` moved in `d`; 0 when `d` is zero.
pub fn gbps(bytes: usize, d: Duration) -> f64 {
    let s = d.as_secs_f64();
    if s > 0.0 { bytes as f64 / s / 1e9 } else { 0.0 }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let op = match self.op {
            Move::Release => "release",
            Move::Resume => "resume",
        };
        write!(
            f,
            "{op} {:.2} GiB in {:.1} ms (sync {:.1} ms)",
            self.bytes() as f64 / (1u64 << 30) as f64,
            ms(self.total),
            ms(self.sync)
        )?;
        let c = &self.copies;
        if c.total_bytes() > 0 {
            write!(
                f,
                "; copied {:.2} GiB by the {} and {:.2} GiB by the {} ({} + {} units)",
                c.bytes_by(Mover::CopyEngine) as f64 / (1u64 << 30) as f64,
                Mover::CopyEngine,
                c.bytes_by(Mover::CopyKernel) as f64 / (1u64 << 30) as f64,
                Mover::CopyKernel,
                c.units[Mover::CopyEngine.index()],
                c.units[Mover::CopyKernel.index()]
            )?;
        }
        for r in &self.regions {
            let s = &r.steps;
            write!(f, "\n  {:<12}", r.tag)?;
            if r.outcome == Outcome::AlreadyDone {
                write!(f, " already {op}d")?;
                continue;
            }
            write!(
                f,
                " {:>8.2} GiB  map {:>7.1} ms  unmap {:>7.1} ms  pin {:>7.1} ms  hash {:>6.1} ms  copy {:>7.1} ms ({:.1} GB/s)  fill {:>6.1} ms",
                r.bytes as f64 / (1u64 << 30) as f64,
                ms(s.map),
                ms(s.unmap),
                ms(s.pin),
                ms(s.hash),
                ms(s.copy),
                gbps(r.copied, s.copy),
                ms(s.fill)
            )?;
        }
        Ok(())
    }
}
