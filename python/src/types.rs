//! Python classes for the pager's values: policies and states, region descriptions,
//! buffers, reports and statistics. They are copies taken when a call returns (plain data),
//! wrapping the core types without PyO3 attributes on them.

use std::time::Duration;

use pyo3::exceptions::PyAttributeError;
use pyo3::prelude::*;
use pyo3::types::PyBool;

/// What happens to a region's contents across a release. Wherever a policy is taken, its
/// name (``"preserve"``, ``"discard"``, ``"discard_zeroed"``) is accepted too.
#[pyclass(module = "gpu_pager", eq, frozen, hash)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Policy {
    /// Copied to pinned host memory on release and restored bit-exact on resume (weights).
    #[pyo3(name = "PRESERVE")]
    Preserve,
    /// Dropped on release; the memory comes back with undefined contents (KV cache).
    #[pyo3(name = "DISCARD")]
    Discard,
    /// Dropped on release; the memory comes back zero-filled.
    #[pyo3(name = "DISCARD_ZEROED")]
    DiscardZeroed,
}

impl Policy {
    /// The core's policy.
    pub(crate) fn core(self) -> gpu_pager::Policy {
        match self {
            Policy::Preserve => gpu_pager::Policy::Preserve,
            Policy::Discard => gpu_pager::Policy::Discard,
            Policy::DiscardZeroed => gpu_pager::Policy::DiscardZeroed,
        }
    }

    fn from_core(p: gpu_pager::Policy) -> Self {
        match p {
            gpu_pager::Policy::Preserve => Policy::Preserve,
            gpu_pager::Policy::Discard => Policy::Discard,
            gpu_pager::Policy::DiscardZeroed => Policy::DiscardZeroed,
        }
    }

    /// The policy named `name`.
    pub(crate) fn from_name(name: &str) -> Option<Self> {
        [Policy::Preserve, Policy::Discard, Policy::DiscardZeroed]
            .into_iter()
            .find(|p| p.name() == name)
    }

    fn name(self) -> &'static str {
        match self {
            Policy::Preserve => "preserve",
            Policy::Discard => "discard",
            Policy::DiscardZeroed => "discard_zeroed",
        }
    }
}

#[pymethods]
impl Policy {
    /// The policy's name: ``"preserve"``, ``"discard"`` or ``"discard_zeroed"``.
    #[getter]
    fn value(&self) -> &'static str {
        self.name()
    }

    fn __str__(&self) -> &'static str {
        self.name()
    }
}

/// Whether a region's physical memory is mapped.
#[pyclass(module = "gpu_pager", eq, frozen, hash)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// Mapped: device addresses are backed by memory.
    #[pyo3(name = "RESIDENT")]
    Resident,
    /// Unmapped: the addresses stay reserved but nothing backs them.
    #[pyo3(name = "RELEASED")]
    Released,
}

impl State {
    fn from_core(s: gpu_pager::State) -> Self {
        match s {
            gpu_pager::State::Resident => State::Resident,
            gpu_pager::State::Released => State::Released,
        }
    }

    fn name(self) -> &'static str {
        match self {
            State::Resident => "resident",
            State::Released => "released",
        }
    }
}

#[pymethods]
impl State {
    /// The state's name: ``"resident"`` or ``"released"``.
    #[getter]
    fn value(&self) -> &'static str {
        self.name()
    }

    fn __str__(&self) -> &'static str {
        self.name()
    }
}

/// A pager's settings (``Pager.config``; chosen with ``gpu_pager.configure`` before the
/// device's first use), sizes as the pager rounded them: one attribute per setting
/// (``gpu_pager.settings()`` lists them with their docs).
#[pyclass(module = "gpu_pager", frozen)]
#[derive(Debug, Clone)]
pub struct Config(pub gpu_pager::PagerConfig);

/// A setting's value as Python holds it: an int, a bool, or a route's name.
pub(crate) fn setting_to_py<'py>(
    py: Python<'py>,
    value: gpu_pager::SettingValue,
) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        gpu_pager::SettingValue::Bytes(n) => n.into_pyobject(py)?.into_any(),
        gpu_pager::SettingValue::Switch(b) => PyBool::new(py, b).to_owned().into_any(),
        gpu_pager::SettingValue::Route(r) => r.name().into_pyobject(py)?.into_any(),
    })
}

/// A setting's value as Python's repr writes it.
fn setting_repr(value: gpu_pager::SettingValue) -> String {
    match value {
        gpu_pager::SettingValue::Switch(true) => "True".to_owned(),
        gpu_pager::SettingValue::Switch(false) => "False".to_owned(),
        gpu_pager::SettingValue::Route(r) => format!("{:?}", r.name()),
        v => v.to_string(),
    }
}

#[pymethods]
impl Config {
    fn __getattr__<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
        match gpu_pager::Setting::named(name) {
            Some(s) => setting_to_py(py, s.get(&self.0)),
            None => Err(PyAttributeError::new_err(format!(
                "'Config' object has no attribute {name:?}"
            ))),
        }
    }

    fn __dir__(&self) -> Vec<&'static str> {
        gpu_pager::SETTINGS.iter().map(|s| s.name).collect()
    }

    fn __repr__(&self) -> String {
        let fields: Vec<String> = gpu_pager::SETTINGS
            .iter()
            .map(|s| format!("{}={}", s.name, setting_repr(s.get(&self.0))))
            .collect();
        format!("Config({})", fields.join(", "))
    }
}

/// A region's description, as it was when the call returned.
#[pyclass(module = "gpu_pager", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct RegionInfo {
    /// The tag.
    pub tag: String,
    /// First device address; never changes while the region exists.
    pub base: u64,
    /// Reserved bytes (the requested size rounded up to the granularity).
    pub size: usize,
    /// Physical chunk size in bytes (the last chunk may be smaller).
    pub chunk_bytes: usize,
    /// Contents policy.
    pub policy: Policy,
    /// Where a ``PRESERVE`` region's contents go while released: ``"pinned"`` (pinned host
    /// memory kept across cycles), ``"host"`` (host memory given back after each resume) or
    /// ``"file"`` (a file in the backup directory); ``"pinned"`` for other policies.
    pub medium: String,
    /// State when the call returned.
    pub state: State,
    /// How its memory is mapped: ``"fixed"`` (all of it while resident), ``"growing"`` (only
    /// under live buffers) or ``"elastic"`` (only where backed: a Rust KV cache's region).
    pub kind: String,
    /// Identity: unique among the regions and buffers of the process.
    pub id: u64,
    /// Releases that changed the region so far.
    pub releases: u64,
}

impl From<gpu_pager::RegionInfo> for RegionInfo {
    fn from(i: gpu_pager::RegionInfo) -> Self {
        RegionInfo {
            tag: i.tag,
            base: i.base,
            size: i.size,
            chunk_bytes: i.chunk_bytes,
            policy: Policy::from_core(i.policy),
            medium: i.medium.to_string(),
            state: State::from_core(i.state),
            kind: i.kind.to_string(),
            id: i.id,
            releases: i.releases,
        }
    }
}

#[pymethods]
impl RegionInfo {
    fn __repr__(&self) -> String {
        format!(
            "RegionInfo(tag={:?}, base={:#x}, size={}, policy={}, medium={:?}, state={}, kind={:?}, id={}, releases={})",
            self.tag,
            self.base,
            self.size,
            self.policy.name(),
            self.medium,
            self.state.name(),
            self.kind,
            self.id,
            self.releases
        )
    }
}

/// A buffer sub-allocated inside a region: a handle (tag, offset, length), not a pointer.
/// Get its device address with ``Pager.ptr`` while the region is resident.
#[pyclass(module = "gpu_pager", frozen, eq, hash)]
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Buffer {
    /// The core's handle.
    pub(crate) inner: gpu_pager::Buffer,
    /// The device of the pager that allocated it.
    pub(crate) device: usize,
}

#[pymethods]
impl Buffer {
    /// The region's tag.
    #[getter]
    fn tag(&self) -> &str {
        self.inner.tag()
    }

    /// Offset in bytes from the region's base address.
    #[getter]
    fn offset(&self) -> usize {
        self.inner.offset()
    }

    /// Length in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.len()
    }

    /// The device of the pager that allocated it.
    #[getter]
    fn device(&self) -> usize {
        self.device
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "Buffer(tag={:?}, offset={}, nbytes={}, device={})",
            self.inner.tag(),
            self.inner.offset(),
            self.inner.len(),
            self.device
        )
    }
}

/// Seconds spent in each step of one region's move.
#[pyclass(module = "gpu_pager", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct Steps {
    /// Allocating the pinned host backup (first release only, unless prepinned).
    pub pin: f64,
    /// Copying contents (device to host on release, host to device on resume).
    pub copy: f64,
    /// Creating and mapping physical memory and enabling access (for a resume that restores
    /// contents, which maps ahead on a helper thread: the time it waited for its mappings).
    pub map: f64,
    /// Unmapping and releasing physical memory.
    pub unmap: f64,
    /// Filling on resume: zeros, or the poison of poisoned discards.
    pub fill: f64,
    /// Hashing contents.
    pub hash: f64,
}

#[pymethods]
impl Steps {
    /// Sum of the steps, in seconds.
    #[getter]
    fn total(&self) -> f64 {
        self.pin + self.copy + self.map + self.unmap + self.fill + self.hash
    }

    fn __repr__(&self) -> String {
        format!(
            "Steps(pin={}, copy={}, map={}, unmap={}, fill={}, hash={})",
            self.pin, self.copy, self.map, self.unmap, self.fill, self.hash
        )
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// One region's part of a ``Report``.
#[pyclass(module = "gpu_pager", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct RegionReport {
    /// The region.
    pub tag: String,
    /// ``"done"`` if the region changed state, ``"already_done"`` if it was already in the
    /// requested state.
    pub outcome: &'static str,
    /// Physical bytes mapped (resume) or unmapped (release).
    pub bytes: usize,
    /// Bytes copied between device and host.
    pub copied: usize,
    /// Seconds per step.
    pub steps: Steps,
}

impl From<&gpu_pager::RegionReport> for RegionReport {
    fn from(r: &gpu_pager::RegionReport) -> Self {
        let s = &r.steps;
        RegionReport {
            tag: r.tag.clone(),
            outcome: match r.outcome {
                gpu_pager::Outcome::Done => "done",
                gpu_pager::Outcome::AlreadyDone => "already_done",
            },
            bytes: r.bytes,
            copied: r.copied,
            steps: Steps {
                pin: secs(s.pin),
                copy: secs(s.copy),
                map: secs(s.map),
                unmap: secs(s.unmap),
                fill: secs(s.fill),
                hash: secs(s.hash),
            },
        }
    }
}

#[pymethods]
impl RegionReport {
    /// Seconds of all steps together.
    #[getter]
    fn seconds(&self) -> f64 {
        self.steps.total()
    }

    fn __repr__(&self) -> String {
        format!(
            "RegionReport(tag={:?}, outcome={:?}, bytes={}, copied={}, seconds={:.6})",
            self.tag,
            self.outcome,
            self.bytes,
            self.copied,
            self.steps.total()
        )
    }
}

/// What one ``release`` or ``resume`` call did.
#[pyclass(module = "gpu_pager", frozen)]
#[derive(Debug, Clone)]
pub struct Report {
    inner: gpu_pager::Report,
}

impl From<gpu_pager::Report> for Report {
    fn from(inner: gpu_pager::Report) -> Self {
        Report { inner }
    }
}

#[pymethods]
impl Report {
    /// ``"release"`` or ``"resume"``.
    #[getter]
    fn op(&self) -> &'static str {
        match self.inner.op {
            gpu_pager::Move::Release => "release",
            gpu_pager::Move::Resume => "resume",
        }
    }

    /// One entry per region named in the call, in tag order.
    #[getter]
    fn regions(&self) -> Vec<RegionReport> {
        self.inner.regions.iter().map(RegionReport::from).collect()
    }

    /// Physical bytes moved in or out of the device's memory map.
    #[getter]
    fn bytes(&self) -> usize {
        self.inner.bytes()
    }

    /// Bytes copied between device and host.
    #[getter]
    fn copied(&self) -> usize {
        self.inner.copied()
    }

    /// Wall time of the whole call, in seconds.
    #[getter]
    fn seconds(&self) -> f64 {
        secs(self.inner.total)
    }

    /// Seconds spent waiting for outstanding device work (release only).
    #[getter]
    fn sync_seconds(&self) -> f64 {
        secs(self.inner.sync)
    }

    /// The entry for ``tag``, or ``None`` if the call did not name it.
    fn region(&self, tag: &str) -> Option<RegionReport> {
        self.inner.region(tag).map(RegionReport::from)
    }

    fn __str__(&self) -> String {
        self.inner.to_string()
    }

    fn __repr__(&self) -> String {
        let tags: Vec<String> = self
            .inner
            .regions
            .iter()
            .map(|r| format!("{:?}", r.tag))
            .collect();
        format!(
            "Report(op={:?}, regions=[{}], bytes={}, copied={}, seconds={:.6})",
            self.op(),
            tags.join(", "),
            self.inner.bytes(),
            self.inner.copied(),
            self.seconds()
        )
    }
}

/// Statistics of one region.
#[pyclass(module = "gpu_pager", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct RegionStats {
    /// The region's description.
    pub info: RegionInfo,
    /// Physical bytes mapped now (for an elastic region: its backed chunks).
    pub resident_bytes: usize,
    /// Reserved bytes with nothing mapped (the whole region while released).
    pub released_bytes: usize,
    /// Bytes in live buffers.
    pub allocated_bytes: usize,
    /// Live buffers.
    pub buffers: usize,
    /// Backup held, in bytes: host memory, or the backup file's size (``info.medium`` says
    /// which).
    pub backup_bytes: usize,
    /// Bytes the backup validly holds: while released, what a resume restores.
    pub held_bytes: usize,
    /// Bytes of live buffers marked overwritten by the next update (see
    /// ``Pager.set_overwritten``), which a release does not save.
    pub marked_bytes: usize,
    /// Live leases.
    pub leases: usize,
    /// The last release that changed this region, if any.
    pub last_release: Option<RegionReport>,
    /// The last resume that changed this region, if any.
    pub last_resume: Option<RegionReport>,
}

impl From<gpu_pager::RegionStats> for RegionStats {
    fn from(s: gpu_pager::RegionStats) -> Self {
        RegionStats {
            info: s.info.into(),
            resident_bytes: s.resident_bytes,
            released_bytes: s.released_bytes,
            allocated_bytes: s.allocated_bytes,
            buffers: s.buffers,
            backup_bytes: s.backup_bytes,
            held_bytes: s.held_bytes,
            marked_bytes: s.marked_bytes,
            leases: s.leases,
            last_release: s.last_release.as_ref().map(RegionReport::from),
            last_resume: s.last_resume.as_ref().map(RegionReport::from),
        }
    }
}

#[pymethods]
impl RegionStats {
    /// The region's tag (``info.tag``).
    #[getter]
    fn tag(&self) -> &str {
        &self.info.tag
    }

    fn __repr__(&self) -> String {
        format!(
            "RegionStats(tag={:?}, state={}, resident_bytes={}, released_bytes={}, \
             allocated_bytes={}, buffers={}, backup_bytes={}, leases={})",
            self.info.tag,
            self.info.state.name(),
            self.resident_bytes,
            self.released_bytes,
            self.allocated_bytes,
            self.buffers,
            self.backup_bytes,
            self.leases
        )
    }
}

/// One region in an ``Audit``.
#[pyclass(module = "gpu_pager", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct AuditRegion {
    /// The tag.
    pub tag: String,
    /// ``State.RESIDENT`` or ``State.RELEASED``.
    pub state: State,
    /// Its policy.
    pub policy: Policy,
    /// ``"fixed"``, ``"growing"`` or ``"elastic"``.
    pub kind: String,
    /// Reserved address range, bytes.
    pub reserved_bytes: usize,
    /// Physical bytes mapped now.
    pub mapped_bytes: usize,
    /// Bytes in live buffers.
    pub allocated_bytes: usize,
    /// Backup held, bytes.
    pub backup_bytes: usize,
}

/// Where a device's memory is, as ``Pager.audit()`` saw it: each region's bytes and state,
/// and the device's use as the driver reports it. ``str()`` is a table.
#[pyclass(module = "gpu_pager", frozen)]
#[derive(Debug, Clone)]
pub struct Audit {
    inner: gpu_pager::Audit,
}

impl From<gpu_pager::Audit> for Audit {
    fn from(inner: gpu_pager::Audit) -> Self {
        Audit { inner }
    }
}

#[pymethods]
impl Audit {
    /// The device's memory in all, bytes.
    #[getter]
    fn device_total_bytes(&self) -> usize {
        self.inner.device_total_bytes
    }
    /// What the driver says is free, bytes.
    #[getter]
    fn device_free_bytes(&self) -> usize {
        self.inner.device_free_bytes
    }
    /// Device memory in use (every holder, other processes included), bytes.
    #[getter]
    fn device_used_bytes(&self) -> usize {
        self.inner.device_used_bytes()
    }
    /// Physical bytes mapped under the pager's regions.
    #[getter]
    fn mapped_bytes(&self) -> usize {
        self.inner.mapped_bytes()
    }
    /// Device memory in use outside every region (other allocators such as torch's own
    /// pools, the CUDA context, other processes), bytes.
    #[getter]
    fn outside_bytes(&self) -> usize {
        self.inner.outside_bytes()
    }
    /// The processes using the device as ``(pid, bytes)``, this one included (``bytes``
    /// ``None`` where NVML does not say), as NVML reports them; ``None`` where NVML is not
    /// there.
    #[getter]
    fn processes(&self) -> Option<Vec<(u32, Option<usize>)>> {
        self.inner
            .processes
            .as_ref()
            .map(|ps| ps.iter().map(|p| (p.pid, p.bytes)).collect())
    }
    /// The node's host budget for backups (``host_budget_bytes``) and each live gpu-pager
    /// process's share of it as ``(pid, bytes)``, largest first, this one included;
    /// ``None`` without a budget.
    #[getter]
    fn host_budget(&self) -> Option<(usize, Vec<(u32, usize)>)> {
        self.inner.host_budget.clone()
    }
    /// Device memory this process holds, bytes; ``None`` where NVML is not there or does
    /// not report this process (a container with a PID namespace of its own).
    #[getter]
    fn this_process_bytes(&self) -> Option<usize> {
        self.inner.this_process_bytes()
    }
    /// Device memory the other processes on the device hold, bytes; ``None`` where NVML is
    /// not there.
    #[getter]
    fn other_processes_bytes(&self) -> Option<usize> {
        self.inner.other_processes_bytes()
    }
    /// Every region, in tag order.
    #[getter]
    fn regions(&self) -> Vec<AuditRegion> {
        self.inner
            .regions
            .iter()
            .map(|r| AuditRegion {
                tag: r.tag.clone(),
                state: State::from_core(r.state),
                policy: Policy::from_core(r.policy),
                kind: r.kind.to_string(),
                reserved_bytes: r.reserved_bytes,
                mapped_bytes: r.mapped_bytes,
                allocated_bytes: r.allocated_bytes,
                backup_bytes: r.backup_bytes,
            })
            .collect()
    }
    fn __str__(&self) -> String {
        self.inner.to_string()
    }
    fn __repr__(&self) -> String {
        format!(
            "Audit(regions={}, mapped_bytes={}, outside_bytes={}, device_free_bytes={})",
            self.inner.regions.len(),
            self.inner.mapped_bytes(),
            self.inner.outside_bytes(),
            self.inner.device_free_bytes
        )
    }
}

/// Statistics of the whole pager, as they were when ``Pager.stats()`` returned.
#[pyclass(module = "gpu_pager", frozen)]
#[derive(Debug, Clone)]
pub struct Stats {
    inner: gpu_pager::Stats,
}

impl From<gpu_pager::Stats> for Stats {
    fn from(inner: gpu_pager::Stats) -> Self {
        Stats { inner }
    }
}

#[pymethods]
impl Stats {
    /// One entry per region, in tag order.
    #[getter]
    fn regions(&self) -> Vec<RegionStats> {
        self.inner
            .regions
            .iter()
            .cloned()
            .map(RegionStats::from)
            .collect()
    }

    /// Physical bytes mapped over all regions.
    #[getter]
    fn resident_bytes(&self) -> usize {
        self.inner.resident_bytes()
    }

    /// Reserved-but-unmapped bytes over all regions.
    #[getter]
    fn released_bytes(&self) -> usize {
        self.inner.released_bytes()
    }

    /// Backup bytes held over all regions (host memory and files).
    #[getter]
    fn backup_bytes(&self) -> usize {
        self.inner.backup_bytes()
    }

    /// The entry for ``tag``, or ``None`` if there is no such region.
    fn region(&self, tag: &str) -> Option<RegionStats> {
        self.inner.region(tag).cloned().map(RegionStats::from)
    }

    /// Failures no call could return (a driver or OS call in a cleanup), not yet taken with
    /// ``Pager.take_deferred_errors()``, oldest first. Each was also logged (``logging``,
    /// logger ``"gpu_pager"``).
    #[getter]
    fn deferred_errors(&self) -> Vec<String> {
        self.inner.deferred_errors.clone()
    }

    /// Such failures since the pager was made, taken or not.
    #[getter]
    fn deferred_errors_total(&self) -> u64 {
        self.inner.deferred_errors_total
    }

    /// A short table: one line for the pager, then one per region.
    fn __str__(&self) -> String {
        self.inner.to_string()
    }

    fn __repr__(&self) -> String {
        let tags: Vec<String> = self
            .inner
            .regions
            .iter()
            .map(|r| format!("{:?}", r.info.tag))
            .collect();
        format!(
            "Stats(regions=[{}], resident_bytes={}, released_bytes={}, backup_bytes={})",
            tags.join(", "),
            self.inner.resident_bytes(),
            self.inner.released_bytes(),
            self.inner.backup_bytes()
        )
    }
}
