//! gpu-pager owns the GPU memory of an LLM rollout engine (weights, KV cache, CUDA-graph
//! pools) as tagged regions at stable device addresses. The engine releases them so that a
//! trainer can use the GPU, then resumes them stage by stage — `weights`, update the
//! weights, then `kv_cache` — without reloading the model or recapturing CUDA graphs.
//!
//! ```
//! use gpu_pager::{Pager, Policy, Error};
//! use gpu_pager::backend::host::{HostBackend, HostConfig};
//! use std::sync::Arc;
//!
//! # fn main() -> Result<(), Error> {
//! // On a GPU use `gpu_pager::registry::open_backend(0)?.0`; the host backend runs anywhere.
//! let pager = Pager::new(Arc::new(HostBackend::new(HostConfig::default())));
//! let weights = pager.region("weights", 64 << 20, Policy::Preserve)?;
//! pager.region("kv_cache", 256 << 20, Policy::Discard)?;
//! let w = pager.alloc("weights", 4096)?;
//! pager.write(&w, 0, &[7u8; 4096])?;
//!
//! pager.release(&["kv_cache", "weights"])?;     // sleep: memory goes back to the device
//! assert!(matches!(pager.ptr(&w), Err(Error::NotResident { .. })));
//!
//! pager.resume(&["weights"])?;                  // stage 1: contents restored bit-exact
//! pager.write(&w, 0, &[8u8; 4096])?;            // update the weights in place
//! pager.resume(&["kv_cache"])?;                 // stage 2
//!
//! assert_eq!(pager.info("weights")?.base, weights.base); // same addresses
//! let mut back = vec![0u8; 4096];
//! pager.read(&w, 0, &mut back)?;
//! assert_eq!(back, vec![8u8; 4096]);
//! # Ok(()) }
//! ```
//!
//! The invariants (see `DESIGN.md` in the repository): addresses never change; release
//! waits for outstanding device work before unmapping; pager-mediated access to a released
//! region is [`Error::NotResident`], never a fault; resume is all or nothing and a failed
//! one (e.g. [`Error::OutOfMemory`]) loses nothing; nothing panics on bad input.

pub mod backend;
mod backup;
mod error;
pub mod kernels;
pub mod kv;
mod map_ahead;
mod mapped;
mod names;
mod pager;
mod pump;
mod ranges;
mod region;
pub mod registry;
pub mod report;
mod runs;
mod suballoc;

pub use backup::file::{BACKUP_DIR_ENV, BackupFiles, MAX_FILE_CHUNK_BYTES};
pub use error::{Error, ErrorCode, Result};
pub use map_ahead::ABSORBED_MAP_ERROR;
#[doc(hidden)]
pub use pager::Tuning;
pub use pager::{
    Audit, AuditRegion, Buffer, Companion, CompanionError, DEFAULT_ALIGN, DEFAULT_CHUNK_BYTES,
    HOST_BUDGET_ENV, Lease, MAX_TAG_BYTES, POISON, POISON_DISCARDS_ENV, PREPIN_ENV, Pager,
    PagerConfig, RECLAIM_SCRUBBED_ENV, RESIDENT_EVENT, RESIDENT_WARNING_BYTES, ReleaseOptions,
    ResumeOptions, SETTINGS, Setting, SettingKind, SettingType, SettingValue, Stats,
};
pub use pump::{CopyRoute, PumpStats};
pub use region::{Medium, Policy, RegionInfo, RegionKind, RegionOptions, RegionStats, State};
pub use report::{Move, Outcome, RegionReport, Report, Steps};

/// Every Rust code block of README.md, compiled and run as a doctest, so the README's
/// examples cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeExamples;

/// Every Rust code block of docs/GUIDE.md, compiled and run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../docs/GUIDE.md")]
pub struct GuideExamples;
