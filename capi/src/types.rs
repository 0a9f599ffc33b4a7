//! The C ABI's types: result codes, enums and the structs the calls fill. Their Rust names
//! are their C names.
#![allow(non_camel_case_types)]

use gpu_pager::backend::BackendKind;
use gpu_pager::report::{Outcome, Report};
use gpu_pager::{CopyRoute, ErrorCode, Medium, PagerConfig, Policy, RegionKind, Stats};

/// The result of every `gpu_pager_*` call: `GPU_PAGER_OK` or the error's code. The numbers
/// are gpu-pager's stable `ErrorCode`s (`Error::code()` in Rust) and never change;
/// `gpu_pager_last_error()` has the message, naming the tag and the fix.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum gpu_pager_code {
    /// Success.
    GPU_PAGER_OK = 0,
    /// The region is released; resume it first.
    GPU_PAGER_ERROR_NOT_RESIDENT = 1,
    /// A range of an elastic region has no physical memory.
    GPU_PAGER_ERROR_NOT_BACKED = 2,
    /// No region has this tag.
    GPU_PAGER_ERROR_UNKNOWN_TAG = 3,
    /// The region is leased and cannot be released now.
    GPU_PAGER_ERROR_BUSY = 4,
    /// The device has not enough free memory; nothing was lost, try again once it has.
    GPU_PAGER_ERROR_OUT_OF_MEMORY = 5,
    /// A size was zero, too large, or not supported.
    GPU_PAGER_ERROR_INVALID_SIZE = 6,
    /// An access outside a buffer or region.
    GPU_PAGER_ERROR_OUT_OF_RANGE = 7,
    /// The buffer is not (or no longer) allocated.
    GPU_PAGER_ERROR_STALE_BUFFER = 8,
    /// The region has no free range large enough.
    GPU_PAGER_ERROR_REGION_FULL = 9,
    /// The tag exists with another policy or size.
    GPU_PAGER_ERROR_TAG_CONFLICT = 10,
    /// Restored contents differ from the backup.
    GPU_PAGER_ERROR_CORRUPTED = 11,
    /// The backup holds a released region's contents.
    GPU_PAGER_ERROR_BACKUP_IN_USE = 12,
    /// An argument (a NULL pointer, a non-UTF-8 tag, an unknown enum value, ...) is not
    /// acceptable.
    GPU_PAGER_ERROR_INVALID_ARGUMENT = 13,
    /// A paged-KV-cache call was refused.
    GPU_PAGER_ERROR_KV = 14,
    /// The device or the operating system failed.
    GPU_PAGER_ERROR_BACKEND = 15,
    /// An invariant of gpu-pager failed (a bug; the message says which, please report it).
    GPU_PAGER_ERROR_INTERNAL = 16,
    /// A companion of a region failed while it moved; the move was undone.
    GPU_PAGER_ERROR_COMPANION = 17,
    /// gpu-pager panicked inside the call (a bug; the message says where).
    GPU_PAGER_ERROR_PANIC = 99,
}

impl From<ErrorCode> for gpu_pager_code {
    /// The C code of a Rust [`ErrorCode`] (an exhaustive match: a new code does not compile
    /// until it has a C name; the numbers are checked equal in the tests).
    fn from(c: ErrorCode) -> Self {
        use gpu_pager_code as C;
        match c {
            ErrorCode::NotResident => C::GPU_PAGER_ERROR_NOT_RESIDENT,
            ErrorCode::NotBacked => C::GPU_PAGER_ERROR_NOT_BACKED,
            ErrorCode::UnknownTag => C::GPU_PAGER_ERROR_UNKNOWN_TAG,
            ErrorCode::Busy => C::GPU_PAGER_ERROR_BUSY,
            ErrorCode::OutOfMemory => C::GPU_PAGER_ERROR_OUT_OF_MEMORY,
            ErrorCode::InvalidSize => C::GPU_PAGER_ERROR_INVALID_SIZE,
            ErrorCode::OutOfRange => C::GPU_PAGER_ERROR_OUT_OF_RANGE,
            ErrorCode::StaleBuffer => C::GPU_PAGER_ERROR_STALE_BUFFER,
            ErrorCode::RegionFull => C::GPU_PAGER_ERROR_REGION_FULL,
            ErrorCode::TagConflict => C::GPU_PAGER_ERROR_TAG_CONFLICT,
            ErrorCode::Corrupted => C::GPU_PAGER_ERROR_CORRUPTED,
            ErrorCode::BackupInUse => C::GPU_PAGER_ERROR_BACKUP_IN_USE,
            ErrorCode::InvalidArgument => C::GPU_PAGER_ERROR_INVALID_ARGUMENT,
            ErrorCode::Kv => C::GPU_PAGER_ERROR_KV,
            ErrorCode::Backend => C::GPU_PAGER_ERROR_BACKEND,
            ErrorCode::Internal => C::GPU_PAGER_ERROR_INTERNAL,
            ErrorCode::Companion => C::GPU_PAGER_ERROR_COMPANION,
            ErrorCode::Panic => C::GPU_PAGER_ERROR_PANIC,
        }
    }
}

/// What happens to a region's contents across a release (`gpu_pager_region`'s `policy`).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum gpu_pager_policy {
    /// Copied to pinned host memory on release, restored bit-exact on resume (weights).
    GPU_PAGER_PRESERVE = 0,
    /// Dropped on release; comes back uninitialised (KV cache).
    GPU_PAGER_DISCARD = 1,
    /// Dropped on release; comes back zero-filled.
    GPU_PAGER_DISCARD_ZEROED = 2,
}

impl gpu_pager_policy {
    /// The policy with this number, if any (C passes it as a plain `uint32_t`).
    pub fn from_number(n: u32) -> Option<Policy> {
        [
            (Self::GPU_PAGER_PRESERVE, Policy::Preserve),
            (Self::GPU_PAGER_DISCARD, Policy::Discard),
            (Self::GPU_PAGER_DISCARD_ZEROED, Policy::DiscardZeroed),
        ]
        .into_iter()
        .find(|(c, _)| *c as u32 == n)
        .map(|(_, p)| p)
    }
}

/// How a region's memory is mapped while resident (`gpu_pager_region`'s `kind`). (The
/// core's third kind, elastic, backs chunks on request for a paged KV cache, which the C ABI
/// does not offer.)
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum gpu_pager_region_kind {
    /// Mapped whole, in chunks: `bytes` must fit in the device.
    GPU_PAGER_FIXED = 0,
    /// Exactly the memory under live buffers (each `gpu_pager_alloc` /
    /// `gpu_pager_torch_malloc` maps its buffer, each free unmaps it); `bytes` is the address
    /// range it reserves, 0 for 4 times the device's memory.
    GPU_PAGER_GROWING = 2,
}

impl gpu_pager_region_kind {
    /// The kind with this number, if any (C passes it as a plain `uint32_t`).
    pub fn from_number(n: u32) -> Option<RegionKind> {
        [
            (Self::GPU_PAGER_FIXED, RegionKind::Fixed),
            (Self::GPU_PAGER_GROWING, RegionKind::Growing),
        ]
        .into_iter()
        .find(|(c, _)| *c as u32 == n)
        .map(|(_, k)| k)
    }
}

/// Where a `GPU_PAGER_PRESERVE` region's contents go while it is released
/// (`gpu_pager_region_medium`'s `medium`).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum gpu_pager_medium {
    /// Pinned host memory, pinned once and kept across cycles (the default).
    GPU_PAGER_MEDIUM_PINNED = 0,
    /// Pinned host memory given back after each resume (pinned again at the next release).
    GPU_PAGER_MEDIUM_HOST = 1,
    /// A file in the backup directory (`gpu_pager_set_backup_dir`), streamed through a
    /// small pinned staging buffer.
    GPU_PAGER_MEDIUM_FILE = 2,
}

impl gpu_pager_medium {
    /// The medium with this number, if any (C passes it as a plain `uint32_t`).
    pub fn from_number(n: u32) -> Option<Medium> {
        [
            (Self::GPU_PAGER_MEDIUM_PINNED, Medium::Pinned),
            (Self::GPU_PAGER_MEDIUM_HOST, Medium::Host),
            (Self::GPU_PAGER_MEDIUM_FILE, Medium::File),
        ]
        .into_iter()
        .find(|(c, _)| *c as u32 == n)
        .map(|(_, m)| m)
    }
}

/// Which movers copy a `GPU_PAGER_PRESERVE` region's contents (`gpu_pager_config`'s
/// `save_route` and `restore_route`).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum gpu_pager_copy_route {
    /// The copy engine only; leaves the SMs to the application.
    GPU_PAGER_ROUTE_ENGINE = 0,
    /// The copy kernel only (zero-copy loads or stores of pinned host memory).
    GPU_PAGER_ROUTE_KERNEL = 1,
    /// Whichever of the two the first 64 MiB of a copy shows faster.
    GPU_PAGER_ROUTE_FASTEST = 2,
}

impl gpu_pager_copy_route {
    const PAIRS: [(Self, CopyRoute); 3] = [
        (Self::GPU_PAGER_ROUTE_ENGINE, CopyRoute::Engine),
        (Self::GPU_PAGER_ROUTE_KERNEL, CopyRoute::Kernel),
        (Self::GPU_PAGER_ROUTE_FASTEST, CopyRoute::Fastest),
    ];

    /// The route with this number, if any (C passes it as a plain `uint32_t`).
    pub fn from_number(n: u32) -> Option<CopyRoute> {
        Self::PAIRS
            .into_iter()
            .find(|(c, _)| *c as u32 == n)
            .map(|(_, r)| r)
    }

    /// The number of `route`.
    pub fn number(route: CopyRoute) -> u32 {
        Self::PAIRS
            .into_iter()
            .find(|(_, r)| *r == route)
            .map_or(Self::GPU_PAGER_ROUTE_FASTEST as u32, |(c, _)| c as u32)
    }
}

/// A device's pager settings (`gpu_pager_configure`, `gpu_pager_get_config`). Start from
/// `gpu_pager_config_default()` and change the fields you choose. Versioned as NCCL's
/// `ncclConfig_t` is: `size` says how much of it the caller's header knows, and fields are
/// only ever added at the end, so a program built against an older header keeps working
/// with a newer library (the fields it does not know keep their defaults).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct gpu_pager_config {
    /// `sizeof(gpu_pager_config)` as the caller was built with: set by
    /// `gpu_pager_config_default()`; keep it.
    pub size: u64,
    /// Physical chunk size in bytes (default 512 MiB); rounded up to the granularity and to
    /// a power of two. Mapping costs per chunk; a region's last chunk wastes at most one
    /// chunk's rounding.
    pub chunk_bytes: u64,
    /// On release, copy only the parts of a `GPU_PAGER_PRESERVE` region that changed since
    /// its last backup or restore (default true).
    pub skip_unchanged: bool,
    /// After each restore, compare the device contents with the backup's hashes; a
    /// mismatch fails the resume with `GPU_PAGER_ERROR_CORRUPTED` (default false: one hash
    /// pass per resume).
    pub verify_restore: bool,
    /// A `gpu_pager_copy_route`: who copies contents to the backup on release (default
    /// `GPU_PAGER_ROUTE_ENGINE`).
    pub save_route: u32,
    /// A `gpu_pager_copy_route`: who restores contents on resume (default
    /// `GPU_PAGER_ROUTE_FASTEST`).
    pub restore_route: u32,
    /// Memory that comes back without its contents (a `GPU_PAGER_DISCARD` region, a tag
    /// dropped at its release) is filled with `GPU_PAGER_POISON` on resume, a NaN read as
    /// bf16, fp16 or fp32 (default false; the environment variable
    /// `GPU_PAGER_POISON_DISCARDS=1` turns it on too).
    pub poison_discards: bool,
    /// A release that moved something logs one warning (through the log callback) when
    /// this process holds more than this many bytes of device memory outside every region
    /// after it (the device's whole use outside the regions where NVML does not report this
    /// process); `gpu_pager_audit` shows all of them (default 4 GiB; `UINT64_MAX`:
    /// never).
    pub resident_warning_bytes: u64,
}

/// The 32-bit pattern of `gpu_pager_config.poison_discards`: a NaN as bf16, fp16 and fp32.
pub const GPU_PAGER_POISON: u32 = 0x7FFF_7FFF;

impl From<PagerConfig> for gpu_pager_config {
    fn from(c: PagerConfig) -> Self {
        gpu_pager_config {
            size: std::mem::size_of::<gpu_pager_config>() as u64,
            chunk_bytes: c.chunk_bytes as u64,
            skip_unchanged: c.skip_unchanged,
            verify_restore: c.verify_restore,
            save_route: gpu_pager_copy_route::number(c.save_route),
            restore_route: gpu_pager_copy_route::number(c.restore_route),
            poison_discards: c.poison_discards,
            resident_warning_bytes: c.resident_warning_bytes as u64,
        }
    }
}

/// `gpu_pager_resume_with`'s flag: keep the host memory of `GPU_PAGER_MEDIUM_HOST` backups
/// after restoring (the next release of unchanged contents then copies nothing).
pub const GPU_PAGER_RESUME_KEEP_HOST_BACKUPS: u32 = 1;

/// Which backend a device's pager runs on.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum gpu_pager_backend_kind {
    /// CUDA virtual memory management on a GPU.
    GPU_PAGER_BACKEND_CUDA = 1,
    /// Host memory standing in for a GPU (no GPU in this machine; device 0 only).
    GPU_PAGER_BACKEND_HOST = 2,
}

/// A device's pager, as `gpu_pager_device` describes it.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gpu_pager_device_info {
    /// CUDA or host.
    pub kind: gpu_pager_backend_kind,
    /// Physical allocation granularity in bytes (region sizes are rounded up to it).
    pub granularity: u64,
    /// Device memory in bytes (on the host backend: its capacity).
    pub total_bytes: u64,
    /// Device memory free now, in bytes.
    pub free_bytes: u64,
}

impl gpu_pager_device_info {
    pub(crate) fn kind_of(kind: BackendKind) -> gpu_pager_backend_kind {
        match kind {
            BackendKind::Cuda => gpu_pager_backend_kind::GPU_PAGER_BACKEND_CUDA,
            BackendKind::Host => gpu_pager_backend_kind::GPU_PAGER_BACKEND_HOST,
        }
    }
}

/// What one `gpu_pager_release`, `gpu_pager_resume` or `gpu_pager_resume_on` call did, over
/// all its regions.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct gpu_pager_report {
    /// Physical bytes unmapped (release) or mapped (resume).
    pub bytes: u64,
    /// Bytes copied between the device and the pinned host backups.
    pub copied: u64,
    /// Regions that changed state.
    pub regions_done: u32,
    /// Regions that were already in the requested state (nothing done).
    pub regions_already: u32,
    /// Wall time of the call, in seconds.
    pub seconds: f64,
    /// Of which waiting for outstanding device work (release), in seconds.
    pub sync_seconds: f64,
}

impl From<&Report> for gpu_pager_report {
    fn from(r: &Report) -> Self {
        let done = r
            .regions
            .iter()
            .filter(|x| x.outcome == Outcome::Done)
            .count();
        gpu_pager_report {
            bytes: r.bytes() as u64,
            copied: r.copied() as u64,
            regions_done: u32::try_from(done).unwrap_or(u32::MAX),
            regions_already: u32::try_from(r.regions.len() - done).unwrap_or(u32::MAX),
            seconds: r.total.as_secs_f64(),
            sync_seconds: r.sync.as_secs_f64(),
        }
    }
}

/// Where a device's memory is (`gpu_pager_audit`), in bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct gpu_pager_audit_totals {
    /// The device's memory in all.
    pub device_total_bytes: u64,
    /// What the driver says is free.
    pub device_free_bytes: u64,
    /// Mapped under the pager's regions.
    pub mapped_bytes: u64,
    /// In use outside every region: other allocators, the CUDA context, other processes.
    pub outside_bytes: u64,
    /// Regions.
    pub regions: u64,
    /// Device memory this process holds, as NVML reports it; `UINT64_MAX` where NVML is
    /// not there or does not report this process (a container's own PID namespace).
    pub this_process_bytes: u64,
    /// Device memory the other processes on the device hold, as NVML reports it;
    /// `UINT64_MAX` where NVML is not there.
    pub other_processes_bytes: u64,
}

/// A device's pager now, over all its regions (`gpu_pager_get_stats`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct gpu_pager_stats {
    /// Physical bytes mapped.
    pub resident_bytes: u64,
    /// Reserved bytes with nothing mapped (released regions).
    pub released_bytes: u64,
    /// Pinned host backup bytes held.
    pub backup_bytes: u64,
    /// Bytes in live buffers.
    pub allocated_bytes: u64,
    /// Regions.
    pub regions: u64,
    /// Live buffers.
    pub buffers: u64,
    /// Live leases.
    pub leases: u64,
    /// Bytes of live buffers marked overwritten by the next update
    /// (`gpu_pager_set_overwritten`), which releases do not save.
    pub marked_bytes: u64,
    /// Bytes the pinned backups validly hold: while released, what a resume restores.
    pub held_bytes: u64,
    /// Failures no call could return (a driver or OS call in a cleanup), not yet taken with
    /// `gpu_pager_take_deferred_errors`.
    pub deferred_errors: u64,
    /// Such failures since the device's pager was made, taken or not.
    pub deferred_errors_total: u64,
}

impl From<&Stats> for gpu_pager_stats {
    fn from(s: &Stats) -> Self {
        let sum =
            |f: fn(&gpu_pager::RegionStats) -> usize| s.regions.iter().map(f).sum::<usize>() as u64;
        gpu_pager_stats {
            resident_bytes: s.resident_bytes() as u64,
            released_bytes: s.released_bytes() as u64,
            backup_bytes: s.backup_bytes() as u64,
            allocated_bytes: sum(|r| r.allocated_bytes),
            regions: s.regions.len() as u64,
            buffers: sum(|r| r.buffers),
            leases: sum(|r| r.leases),
            marked_bytes: sum(|r| r.marked_bytes),
            held_bytes: sum(|r| r.held_bytes),
            deferred_errors: s.deferred_errors.len() as u64,
            deferred_errors_total: s.deferred_errors_total,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every error code (not `GPU_PAGER_OK`), in numeric order.
    const ERRORS: [gpu_pager_code; 18] = [
        gpu_pager_code::GPU_PAGER_ERROR_NOT_RESIDENT,
        gpu_pager_code::GPU_PAGER_ERROR_NOT_BACKED,
        gpu_pager_code::GPU_PAGER_ERROR_UNKNOWN_TAG,
        gpu_pager_code::GPU_PAGER_ERROR_BUSY,
        gpu_pager_code::GPU_PAGER_ERROR_OUT_OF_MEMORY,
        gpu_pager_code::GPU_PAGER_ERROR_INVALID_SIZE,
        gpu_pager_code::GPU_PAGER_ERROR_OUT_OF_RANGE,
        gpu_pager_code::GPU_PAGER_ERROR_STALE_BUFFER,
        gpu_pager_code::GPU_PAGER_ERROR_REGION_FULL,
        gpu_pager_code::GPU_PAGER_ERROR_TAG_CONFLICT,
        gpu_pager_code::GPU_PAGER_ERROR_CORRUPTED,
        gpu_pager_code::GPU_PAGER_ERROR_BACKUP_IN_USE,
        gpu_pager_code::GPU_PAGER_ERROR_INVALID_ARGUMENT,
        gpu_pager_code::GPU_PAGER_ERROR_KV,
        gpu_pager_code::GPU_PAGER_ERROR_BACKEND,
        gpu_pager_code::GPU_PAGER_ERROR_INTERNAL,
        gpu_pager_code::GPU_PAGER_ERROR_COMPANION,
        gpu_pager_code::GPU_PAGER_ERROR_PANIC,
    ];

    /// `GPU_PAGER_ERROR_NOT_RESIDENT` for `NotResident`, as `ErrorCode`'s `Display` documents.
    fn c_name(c: gpu_pager_code) -> String {
        format!("{c:?}")
    }

    fn screaming(name: &str) -> String {
        let mut out = String::new();
        for (i, ch) in name.chars().enumerate() {
            if ch.is_uppercase() && i > 0 {
                out.push('_');
            }
            out.push(ch.to_ascii_uppercase());
        }
        out
    }

    #[test]
    fn the_c_poison_is_the_core_s() {
        assert_eq!(GPU_PAGER_POISON, gpu_pager::POISON);
    }

    #[test]
    fn c_codes_mirror_error_code_all() {
        assert_eq!(ERRORS.len(), ErrorCode::ALL.len());
        for (rust, c) in ErrorCode::ALL.into_iter().zip(ERRORS) {
            assert_eq!(gpu_pager_code::from(rust), c);
            assert_eq!(c as u32, rust.number(), "{c:?} vs {rust}");
            assert_eq!(
                c_name(c),
                format!("GPU_PAGER_ERROR_{}", screaming(&rust.to_string()))
            );
        }
        assert_eq!(gpu_pager_code::GPU_PAGER_OK as u32, 0);
        assert_eq!(ErrorCode::from_number(0), None);
    }

    #[test]
    fn policies_by_number() {
        assert_eq!(gpu_pager_policy::from_number(0), Some(Policy::Preserve));
        assert_eq!(gpu_pager_policy::from_number(1), Some(Policy::Discard));
        assert_eq!(
            gpu_pager_policy::from_number(2),
            Some(Policy::DiscardZeroed)
        );
        assert_eq!(gpu_pager_policy::from_number(3), None);
    }
}
