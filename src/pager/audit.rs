//! The residency audit: where the device's memory is, for one pager. Each region's mapped,
//! reserved and backed-up bytes and its state, the device's use as the driver reports it,
//! and what of that lies outside every region (another allocator's memory, the CUDA context
//! and libraries, other processes). A release warns when much stays resident after it.

use super::*;
use crate::backend::{DeviceProcess, MemInfo};
use crate::names::gib;

/// The `event` field of the log record that warns of device memory still in use after a
/// release (with the fields `device` and `outside_bytes`).
pub const RESIDENT_EVENT: &str = "resident_after_release";

/// The default of [`PagerConfig::resident_warning_bytes`]: 4 GiB, above a CUDA context and
/// a test's small workload, below what an engine that forgot a buffer holds.
pub const RESIDENT_WARNING_BYTES: usize = 4 << 30;

/// One region in an [`Audit`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditRegion {
    /// The tag.
    pub tag: String,
    /// Resident or released.
    pub state: State,
    /// Its policy.
    pub policy: Policy,
    /// Its kind.
    pub kind: RegionKind,
    /// Reserved address range, bytes.
    pub reserved_bytes: usize,
    /// Physical bytes mapped now.
    pub mapped_bytes: usize,
    /// Bytes in live buffers.
    pub allocated_bytes: usize,
    /// Backup held, bytes (pinned or host memory, or file).
    pub backup_bytes: usize,
}

impl AuditRegion {
    fn of(s: RegionStats) -> AuditRegion {
        AuditRegion {
            tag: s.info.tag,
            state: s.info.state,
            policy: s.info.policy,
            kind: s.info.kind,
            reserved_bytes: s.info.size,
            mapped_bytes: s.resident_bytes,
            allocated_bytes: s.allocated_bytes,
            backup_bytes: s.backup_bytes,
        }
    }
}

/// Where a device's memory is, as one call saw it ([`Pager::audit`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Audit {
    /// The device's memory in all, bytes.
    pub device_total_bytes: usize,
    /// What the driver says is free now, bytes.
    pub device_free_bytes: usize,
    /// Every region, in tag order.
    pub regions: Vec<AuditRegion>,
    /// The processes using the device and their device memory, this one included, as the
    /// driver's management library (NVML) reports them; `None` where it is not there.
    pub processes: Option<Vec<DeviceProcess>>,
    /// The node's host budget for backups ([`crate::PagerConfig::host_budget_bytes`]) and
    /// each live process's share of it as (pid, bytes), largest first; `None` without a
    /// budget.
    pub host_budget: Option<(usize, Vec<(u32, usize)>)>,
}

impl Audit {
    /// Device memory in use now (every holder, other processes included), bytes.
    pub fn device_used_bytes(&self) -> usize {
        self.device_total_bytes
            .saturating_sub(self.device_free_bytes)
    }

    /// Physical bytes mapped under the pager's regions.
    pub fn mapped_bytes(&self) -> usize {
        self.regions.iter().map(|r| r.mapped_bytes).sum()
    }

    /// Device memory in use outside every region: other allocators of this process (torch's
    /// own pools), the CUDA context and libraries, and other processes on the device.
    pub fn outside_bytes(&self) -> usize {
        self.device_used_bytes().saturating_sub(self.mapped_bytes())
    }

    /// Device memory this process holds (its CUDA context, its regions and every other
    /// allocator in it), where NVML reports it under this process's id (not inside a
    /// container with a PID namespace of its own).
    pub fn this_process_bytes(&self) -> Option<usize> {
        let me = std::process::id();
        self.processes
            .as_ref()?
            .iter()
            .find(|p| p.pid == me)
            .and_then(|p| p.bytes)
    }

    /// Device memory the other processes on the device hold, where NVML reports it.
    pub fn other_processes_bytes(&self) -> Option<usize> {
        let me = std::process::id();
        Some(
            self.processes
                .as_ref()?
                .iter()
                .filter(|p| p.pid != me)
                .filter_map(|p| p.bytes)
                .sum(),
        )
    }

    /// The entry for `tag`.
    pub fn region(&self, tag: &str) -> Option<&AuditRegion> {
        self.regions.iter().find(|r| r.tag == tag)
    }

    /// The resident regions holding memory, largest first.
    pub fn largest_resident(&self) -> Vec<&AuditRegion> {
        let mut held: Vec<&AuditRegion> =
            self.regions.iter().filter(|r| r.mapped_bytes > 0).collect();
        held.sort_by(|a, b| b.mapped_bytes.cmp(&a.mapped_bytes).then(a.tag.cmp(&b.tag)));
        held
    }
}

/// A tag as one line of text: control characters (a newline would split a table's row or
/// a log line) escaped as Rust writes them (`\n`).
fn shown(tag: &str) -> std::borrow::Cow<'_, str> {
    if tag.chars().any(char::is_control) {
        std::borrow::Cow::Owned(tag.escape_debug().to_string())
    } else {
        std::borrow::Cow::Borrowed(tag)
    }
}

/// A table: one line per region, then the device's totals.
impl std::fmt::Display for Audit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{:<24} {:<9} {:<15} {:>12} {:>12} {:>12}",
            "tag", "state", "policy", "mapped", "reserved", "backup"
        )?;
        for r in &self.regions {
            writeln!(
                f,
                "{:<24} {:<9} {:<15} {:>12} {:>12} {:>12}",
                shown(&r.tag),
                format!("{:?}", r.state).to_lowercase(),
                format!("{:?}", r.policy).to_lowercase(),
                gib(r.mapped_bytes),
                gib(r.reserved_bytes),
                gib(r.backup_bytes)
            )?;
        }
        write!(
            f,
            "device: {} used of {} ({} free); in regions {}, outside every region {} (other \
             allocators, the CUDA context, other processes)",
            gib(self.device_used_bytes()),
            gib(self.device_total_bytes),
            gib(self.device_free_bytes),
            gib(self.mapped_bytes()),
            gib(self.outside_bytes())
        )?;
        match &self.processes {
            None => write!(f, "\nprocesses on the device: unknown (NVML is not there)")?,
            Some(listed) => {
                let me = std::process::id();
                let each: Vec<String> = listed
                    .iter()
                    .map(|p| {
                        format!(
                            "{}{} {}",
                            p.pid,
                            if p.pid == me { " (this one)" } else { "" },
                            p.bytes.map_or_else(|| "unknown".to_owned(), gib)
                        )
                    })
                    .collect();
                write!(f, "\nprocesses on the device: {}", each.join(", "))?;
            }
        }
        if let Some((budget, shares)) = &self.host_budget {
            let used: usize = shares.iter().map(|s| s.1).sum();
            write!(
                f,
                "\nhost budget for backups on this node: {} used of {} ({})",
                gib(used),
                gib(*budget),
                crate::backend::shown_shares(shares)
            )?;
        }
        Ok(())
    }
}

impl Pager {
    /// Where the device's memory is now: each region's bytes and state, the device's use
    /// as the driver reports it, and the processes on the device where NVML is there (see
    /// [`Audit`]). Takes each region's lock in turn, not all at once: a move running
    /// meanwhile shows before or after.
    pub fn audit(&self) -> Result<Audit> {
        self.check_process()?;
        let mem = self
            .backend
            .mem_info()
            .map_err(|e| Error::backend_of(&[], "querying device memory", e))?;
        let mut audit = self.audit_regions(mem);
        audit.processes = self.backend.processes();
        let budget = self.config.host_budget_bytes;
        if budget != usize::MAX {
            let shares = crate::backup::ledger::Ledger::process()
                .and_then(|l| l.shares())
                .map_err(|error| {
                    Error::backend_of(
                        &[],
                        "reading the host budget's ledger",
                        crate::backend::BackendError::Os {
                            op: "reading the ledger",
                            error,
                        },
                    )
                })?;
            audit.host_budget = Some((budget, shares));
        }
        Ok(audit)
    }

    /// The audit of the regions against the driver's `mem`, without the processes (no
    /// NVML query).
    fn audit_regions(&self, mem: MemInfo) -> Audit {
        let regions = self
            .stats()
            .regions
            .into_iter()
            .map(AuditRegion::of)
            .collect();
        Audit {
            device_total_bytes: mem.total,
            device_free_bytes: mem.free,
            regions,
            processes: None,
            host_budget: None,
        }
    }

    /// [`Pager::audit_regions`] if every region and the map can be had at once, without
    /// waiting (`None` otherwise).
    fn audit_regions_now(&self, mem: MemInfo) -> Option<Audit> {
        let map = match self.regions.try_read() {
            Ok(map) => map,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        let mut regions = Vec::with_capacity(map.len());
        for slot in map.values() {
            let region = match slot.try_lock() {
                Ok(r) => r,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => return None,
            };
            regions.push(AuditRegion::of(region.stats()));
        }
        Some(Audit {
            device_total_bytes: mem.total,
            device_free_bytes: mem.free,
            regions,
            processes: None,
            host_budget: None,
        })
    }
}

/// After a release of `tags` that moved something: one warning when this process holds
/// more than [`PagerConfig::resident_warning_bytes`] of device memory outside every
/// region (the device's whole use outside the regions where NVML does not report this
/// process). Regions left resident do not count: a release in stages keeps them on
/// purpose, and the audit lists them. Never fails the release: an audit that cannot be
/// had is skipped.
pub(super) fn warn_if_resident(pager: &Pager, tags: &[&str]) {
    let limit = pager.config.resident_warning_bytes;
    if limit == usize::MAX {
        return;
    }
    // One driver query per release; the regions are listed, and NVML asked, only when
    // the device's use outside them is above the limit.
    let Ok(mem) = pager.backend.mem_info() else {
        return;
    };
    if mem.total.saturating_sub(mem.free) <= limit {
        return;
    }
    // Never waits for a region or the map: the warning is advice, and this runs after
    // a release that may itself run in another tag's companion (whose region this
    // thread holds), beside moves of other tags on other threads.
    let Some(mut audit) = pager.audit_regions_now(mem) else {
        return;
    };
    if audit.outside_bytes() <= limit {
        return;
    }
    audit.processes = pager.backend.processes();
    let (outside, whose, others) = match audit.this_process_bytes() {
        Some(mine) => (
            mine.saturating_sub(audit.mapped_bytes()),
            "this process's",
            "",
        ),
        None => (audit.outside_bytes(), "the device's", ", other processes"),
    };
    if outside <= limit {
        return;
    }
    let resident: Vec<String> = audit
        .largest_resident()
        .into_iter()
        .take(3)
        .map(|r| format!("`{}` {}", shown(&r.tag), gib(r.mapped_bytes)))
        .collect();
    let resident = if resident.is_empty() {
        "none".to_owned()
    } else {
        resident.join(", ")
    };
    let device = pager.backend.info().ordinal.unwrap_or(0);
    // The fields carry the warning as data, for a binding that adds what it knows
    // (Python's torch module names torch's largest holders) without reading the text.
    log::warn!(
        target: "gpu_pager",
        event = RESIDENT_EVENT, device = device, outside_bytes = outside;
        "gpu-pager: device {}: after releasing {tags:?}, {} of {whose} device memory is \
         still in use outside every region (more than {}: another allocator, the CUDA \
         context{others}); regions left resident: {resident}; Pager::audit / \
         gpu_pager.torch.audit() shows all of it",
        device,
        gib(outside),
        gib(limit),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn audit(processes: Option<Vec<DeviceProcess>>) -> Audit {
        Audit {
            device_total_bytes: 80 << 30,
            device_free_bytes: 60 << 30,
            regions: Vec::new(),
            processes,
            host_budget: None,
        }
    }

    #[test]
    fn this_process_and_the_others_come_from_nvml_s_list() {
        let me = std::process::id();
        let listed = vec![
            DeviceProcess {
                pid: me.wrapping_add(1),
                bytes: Some(12 << 30),
            },
            DeviceProcess {
                pid: me,
                bytes: Some(7 << 30),
            },
            DeviceProcess {
                pid: me.wrapping_add(2),
                bytes: None,
            },
        ];
        let a = audit(Some(listed));
        assert_eq!(a.this_process_bytes(), Some(7 << 30));
        assert_eq!(a.other_processes_bytes(), Some(12 << 30));
        let table = a.to_string();
        assert!(
            table.contains(&format!("{me} (this one) 7.00 GiB")),
            "{table}"
        );
        assert!(table.contains(" unknown"), "{table}");
        // A container's own PID namespace: NVML lists the host's ids, not this one.
        let elsewhere = audit(Some(vec![DeviceProcess {
            pid: me.wrapping_add(1),
            bytes: Some(1),
        }]));
        assert_eq!(elsewhere.this_process_bytes(), None);
        let none = audit(None);
        assert_eq!(
            (none.this_process_bytes(), none.other_processes_bytes()),
            (None, None)
        );
        assert!(none.to_string().contains("NVML is not there"));
    }
}
