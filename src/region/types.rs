//! What a region is and says of itself: its policy, backup medium, state and kind, the
//! options it is created with, its description and statistics.

pub use crate::backup::Medium;
use crate::report::RegionReport;

/// What happens to a region's contents across a release.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Policy {
    /// Copied to pinned host memory on release and restored bit-exact on resume (weights).
    Preserve,
    /// Dropped on release; the memory comes back uninitialised (KV cache).
    Discard,
    /// Dropped on release; the memory comes back zero-filled.
    DiscardZeroed,
}

/// Whether a region's physical memory is mapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// Mapped: device addresses are backed by memory.
    Resident,
    /// Unmapped: the addresses stay reserved but nothing backs them.
    Released,
}

/// How a region's memory is mapped while it is resident.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum RegionKind {
    /// The whole region, in chunks: its size must fit in the device.
    #[default]
    Fixed,
    /// Only the chunks asked for ([`crate::Pager::back`], given back with
    /// [`crate::Pager::trim`]): a paged KV cache. Created and resumed with nothing mapped,
    /// so its contents cannot be preserved: [`Policy::Discard`] and
    /// [`Policy::DiscardZeroed`] only. Reserves at most 4 times the device's memory.
    Elastic,
    /// Exactly the memory under its live buffers: an allocation maps its buffer, a free
    /// unmaps it (the memory torch's caching allocator asks for, segment by segment). Any
    /// policy. Its size is the address range it reserves, 0 for 4 times the device's
    /// memory.
    Growing,
}

crate::names::short_names!(RegionKind, "kind", {
    Fixed => "fixed",
    Elastic => "elastic",
    Growing => "growing",
});

impl std::fmt::Display for RegionKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Options fixed when a region is created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegionOptions {
    /// Allocate the pinned host backup now (Preserve only), so the first release pays no
    /// pinning on its critical path. In a growing region each buffer's backup is pinned
    /// when the buffer is allocated.
    pub prepin: bool,
    /// How the region's memory is mapped (default [`RegionKind::Fixed`]).
    pub kind: RegionKind,
    /// Physical chunk size for this region instead of [`crate::PagerConfig::chunk_bytes`],
    /// rounded the same way (up to the granularity and to a power of two). Elastic regions
    /// map and unmap whole chunks, so smaller chunks follow their use more closely.
    pub chunk_bytes: Option<usize>,
    /// Where the contents go while released ([`Policy::Preserve`] only; default
    /// [`Medium::Pinned`]).
    pub medium: Medium,
}

impl RegionOptions {
    /// The defaults, for a [`RegionKind::Growing`] region.
    pub const GROWING: RegionOptions = RegionOptions::of(RegionKind::Growing);
    /// The defaults, for a [`RegionKind::Elastic`] region.
    pub const ELASTIC: RegionOptions = RegionOptions::of(RegionKind::Elastic);

    /// The defaults, for a region of `kind`.
    const fn of(kind: RegionKind) -> RegionOptions {
        RegionOptions {
            prepin: false,
            kind,
            chunk_bytes: None,
            medium: Medium::Pinned,
        }
    }
}

/// A public description of a region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionInfo {
    /// The tag.
    pub tag: String,
    /// First device address; never changes while the region exists.
    pub base: u64,
    /// Reserved bytes (the requested size rounded up to the granularity; for a growing
    /// region, the whole reservation).
    pub size: usize,
    /// Physical chunk size (the last chunk may be smaller); in a growing region, the
    /// largest piece one buffer is mapped in.
    pub chunk_bytes: usize,
    /// Contents policy.
    pub policy: Policy,
    /// Backup medium ([`Medium::Pinned`] for regions without a backup).
    pub medium: Medium,
    /// Current state.
    pub state: State,
    /// How its memory is mapped.
    pub kind: RegionKind,
    /// Identity of the region: unique among the regions and buffers of the process, so a region
    /// removed and created again under the same tag has a new id.
    pub id: u64,
    /// Releases that changed the region so far (see [`crate::Pager::releases`]).
    pub releases: u64,
}

/// Per-region statistics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionStats {
    /// The region.
    pub info: RegionInfo,
    /// Physical bytes mapped now (for an elastic region: its backed chunks).
    pub resident_bytes: usize,
    /// Bytes a resume would map (or an elastic region could back) that are not mapped now:
    /// the whole region while a fixed one is released; the buffers' bytes while a growing
    /// one is.
    pub released_bytes: usize,
    /// Bytes in live buffers.
    pub allocated_bytes: usize,
    /// Live buffers.
    pub buffers: usize,
    /// Backup held, in bytes: pinned host memory, or the backup files' size
    /// ([`RegionInfo::medium`] says which).
    pub backup_bytes: usize,
    /// Bytes the backup validly holds: while released, exactly what a resume restores.
    pub held_bytes: usize,
    /// Bytes of live buffers marked overwritten by the next update
    /// ([`crate::Pager::set_overwritten`]): a release neither hashes nor copies them. In a
    /// growing region a mark that reaches a buffer's end also covers the buffer's padding up
    /// to the granularity.
    pub marked_bytes: usize,
    /// Live leases.
    pub leases: usize,
    /// The last release that changed this region.
    pub last_release: Option<RegionReport>,
    /// The last resume that changed this region.
    pub last_resume: Option<RegionReport>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_ones_are_none() {
        for m in Medium::ALL {
            assert_eq!(Medium::from_name(m.name()), Some(m));
            assert_eq!(m.to_string(), m.name());
        }
        for k in RegionKind::ALL {
            assert_eq!(RegionKind::from_name(k.name()), Some(k));
            assert_eq!(k.to_string(), k.name());
        }
        assert_eq!(Medium::from_name("disk"), None);
        assert_eq!(RegionKind::from_name("Fixed"), None);
    }
}
