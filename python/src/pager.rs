//! `gpu_pager.Pager` and `gpu_pager.Lease`: thin wrappers over [`gpu_pager::Pager`] and
//! [`gpu_pager::Lease`]. Every call that takes a pager lock releases the GIL.

use std::sync::{Arc, Mutex};

use gpu_pager::RegionOptions;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::args::{self, as_strs, run};
use crate::errors;
use crate::types::{Buffer, RegionInfo, RegionStats, Report, Stats};

/// The process's pager for one device: tagged regions of device memory at stable
/// addresses, released and resumed by tag. Get it with ``Pager.for_device(device)``; every
/// call for a device returns the same pager. Thread-safe: calls release the GIL, moves of
/// different tags may run concurrently from different threads.
#[pyclass(module = "gpu_pager", name = "Pager", frozen)]
pub struct PyPager {
    device: usize,
    inner: Arc<gpu_pager::Pager>,
}

impl PyPager {
    /// `n` bytes of `buf` from `offset` by `read` (the device, or the backup), the range
    /// checked first so that a bad one fails before the allocation.
    fn read_with<'py>(
        &self,
        py: Python<'py>,
        buf: &Buffer,
        offset: &Bound<'_, PyAny>,
        n: &Bound<'_, PyAny>,
        read: fn(&gpu_pager::Pager, &gpu_pager::Buffer, usize, &mut [u8]) -> gpu_pager::Result<()>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.check_device(py, buf)?;
        let offset = args::size(offset, "offset")?;
        let n = args::size(n, "n")?;
        let (p, b) = (&self.inner, &buf.inner);
        let out = run(py, || {
            if offset.checked_add(n).is_none_or(|end| end > b.len()) {
                return Err(gpu_pager::Error::OutOfRange {
                    tag: b.tag().to_owned(),
                    what: "buffer",
                    offset,
                    len: n,
                    size: b.len(),
                });
            }
            // A failed allocation is an error, not an abort of the interpreter.
            let mut out = Vec::new();
            out.try_reserve_exact(n).map_err(|_| {
                gpu_pager::Error::backend(
                    b.tag(),
                    "allocating the bytes to read",
                    gpu_pager::backend::BackendError::HostOutOfMemory { requested: n },
                )
            })?;
            out.resize(n, 0);
            read(p, b, offset, &mut out)?;
            Ok(out)
        })?;
        Ok(PyBytes::new(py, &out))
    }

    /// A buffer of another device's pager is `InvalidArgumentError`.
    fn check_device(&self, py: Python<'_>, buf: &Buffer) -> PyResult<()> {
        if buf.device == self.device {
            return Ok(());
        }
        let e = gpu_pager::Error::InvalidArgument {
            tag: Some(buf.inner.tag().to_owned()),
            reason: format!(
                "the buffer belongs to device {}'s pager, not device {}'s",
                buf.device, self.device
            ),
        };
        Err(crate::errors::to_py(py, &e))
    }
}

/// Chooses the settings of device ``device``'s pager (default 0) before its first use
/// (before ``Pager.for_device`` or anything else opens it), one keyword per setting; a
/// setting left out, or ``None``, keeps its default. A byte count is an int, a switch a
/// bool, a route ``"engine"``, ``"kernel"`` or ``"fastest"``; anything else is
/// ``TypeError`` or ``ValueError``, an unknown keyword ``TypeError`` naming the settings.
/// Until the pager exists a later call replaces the settings; afterwards the same settings
/// are accepted and others are ``InvalidArgumentError``, changing nothing.
#[pyfunction]
#[pyo3(signature = (device = None, **settings), text_signature = "(device=0, **settings)")]
pub(crate) fn configure(
    py: Python<'_>,
    device: Option<&Bound<'_, PyAny>>,
    settings: Option<&Bound<'_, PyDict>>,
) -> PyResult<()> {
    let device = device.map_or(Ok(0), |d| args::size(d, "device"))?;
    let mut config = gpu_pager::PagerConfig::default();
    for (key, value) in settings.into_iter().flat_map(|kw| kw.iter()) {
        let name: String = key.extract()?;
        let Some(setting) = gpu_pager::Setting::named(&name) else {
            return Err(PyTypeError::new_err(format!(
                "configure() got an unexpected keyword argument {name:?}; the settings: {}",
                gpu_pager::SETTINGS
                    .iter()
                    .map(|s| s.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        };
        if value.is_none() {
            continue;
        }
        let value = args::setting(&value, setting)?;
        setting
            .set(&mut config, value)
            .map_err(|e| errors::to_py(py, &e))?;
    }
    run(py, || gpu_pager::Pager::configure(device, config))
}

/// One setting as `settings()` lists it: name, kind, default, doc.
type SettingRow = (&'static str, &'static str, Py<PyAny>, String);

/// Every setting ``configure`` takes, in order: ``(name, kind, default, doc)``, the kind
/// ``"bytes"`` (an int), ``"switch"`` (a bool) or ``"route"`` (``"engine"``, ``"kernel"``
/// or ``"fastest"``).
#[pyfunction]
pub(crate) fn settings(py: Python<'_>) -> PyResult<Vec<SettingRow>> {
    gpu_pager::SETTINGS
        .iter()
        .map(|s| {
            Ok((
                s.name,
                s.kind.name(),
                crate::types::setting_to_py(py, s.default())?.unbind(),
                s.doc(),
            ))
        })
        .collect()
}

#[pymethods]
impl PyPager {
    /// The pager of CUDA device ``device`` (default 0), created on first use. Device 0 runs
    /// on host memory when there is no GPU (see ``backend`` and ``host_fallback``); its
    /// capacity is then read from the environment variable ``GPU_PAGER_HOST_CAPACITY``
    /// (e.g. ``"8G"``) when the pager is created. ``device`` is an int ``>= 0``: a bool is
    /// ``TypeError``, a negative number ``ValueError``.
    #[staticmethod]
    #[pyo3(signature = (device = None), text_signature = "(device=0)")]
    fn for_device(py: Python<'_>, device: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let device = device.map_or(Ok(0), |d| args::size(d, "device"))?;
        let inner = run(py, || gpu_pager::Pager::for_device(device))?;
        Ok(PyPager { device, inner })
    }

    /// The device ordinal.
    #[getter]
    fn device(&self) -> usize {
        self.device
    }

    /// The pager's settings (see ``gpu_pager.configure``), sizes as the pager rounded them.
    #[getter]
    fn config(&self) -> crate::types::Config {
        crate::types::Config(self.inner.config())
    }

    /// ``"cuda"`` on a GPU, ``"host"`` on host memory standing in for one.
    #[getter]
    fn backend(&self) -> String {
        self.inner.backend_kind().to_string()
    }

    /// Why the pager runs on host memory (the CUDA backend's error), or ``None`` on a GPU.
    #[getter]
    fn host_fallback(&self) -> Option<String> {
        match self.inner.backend_kind() {
            gpu_pager::backend::BackendKind::Host => gpu_pager::registry::host_fallback(),
            gpu_pager::backend::BackendKind::Cuda => None,
        }
    }

    /// Creates region ``tag`` of ``bytes`` (rounded up to the granularity) with ``policy``
    /// (a ``Policy`` or its name), resident, at a device address that never changes, and
    /// returns its description. Asking again for an existing tag with the same kind, size and
    /// policy returns the existing region; otherwise ``TagConflictError``. ``kind`` is
    /// ``"fixed"`` (all ``bytes`` mapped while resident) or ``"growing"`` (memory mapped only
    /// under live buffers; ``bytes`` is the address range it reserves, ``None`` for 4 times
    /// the device's memory); by default ``"growing"`` without ``bytes``, else ``"fixed"``.
    /// ``prepin`` allocates the pinned host backup now (``Policy.PRESERVE`` only), so that
    /// the first release pays no pinning.
    /// ``medium`` says where a ``PRESERVE`` region's contents go while it is released:
    /// ``"pinned"`` (pinned host memory kept across cycles: the fastest), ``"host"`` (host
    /// memory given back after each resume, pinned again at the next release) or ``"file"``
    /// (a file in the backup directory, ``set_backup_dir``, for hosts whose memory cannot
    /// hold the weights).
    #[pyo3(signature = (tag, policy, bytes = None, prepin = false, medium = "pinned", kind = None))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments, one parameter each
    fn region(
        &self,
        py: Python<'_>,
        tag: &str,
        policy: &Bound<'_, PyAny>,
        bytes: Option<&Bound<'_, PyAny>>,
        prepin: bool,
        medium: &str,
        kind: Option<&str>,
    ) -> PyResult<RegionInfo> {
        let policy = args::policy(policy)?;
        let medium = args::medium(medium)?;
        let bytes = bytes.map(|b| args::size(b, "bytes")).transpose()?;
        let kind = match kind {
            Some(k) => args::region_kind(k)?,
            None if bytes.is_none() => gpu_pager::RegionKind::Growing,
            None => gpu_pager::RegionKind::Fixed,
        };
        let options = RegionOptions {
            prepin,
            medium,
            kind,
            ..RegionOptions::default()
        };
        // A growing region without a size reserves the core's default range.
        let bytes = bytes.unwrap_or(0);
        let p = &self.inner;
        run(py, || p.region_with(tag, bytes, policy, options)).map(RegionInfo::from)
    }

    /// Makes ``path`` (created if missing) the directory where new ``"file"`` backups go,
    /// after checking that a file can be written there (``InvalidArgumentError`` otherwise).
    /// A pager starts with ``GPU_PAGER_BACKUP_DIR`` from the environment. Put it on a real
    /// disk: on tmpfs the files take the host memory they are meant to spare.
    fn set_backup_dir(&self, py: Python<'_>, path: std::path::PathBuf) -> PyResult<()> {
        let p = &self.inner;
        run(py, || p.set_backup_dir(&path))
    }

    /// The directory new ``"file"`` backups go to, or ``None`` while none is set.
    #[getter]
    fn backup_dir(&self) -> Option<String> {
        self.inner.backup_dir().map(|d| d.display().to_string())
    }

    /// Registers a companion of region ``tag`` (which need not exist yet): work that moves
    /// with it. Each release of ``tag`` calls ``before_release(tag)`` after the contents are
    /// saved and before the memory is unmapped; each resume calls ``after_resume(tag)``
    /// after the memory is mapped and restored. Either may be ``None``. An exception from
    /// one undoes the move: the companions that ran are undone (each by its other callable,
    /// newest first), every region stays as before the call, and the call raises
    /// ``CompanionError`` naming ``name``. A tag's companions run in registration order on
    /// resume and in reverse on release, on the thread that releases or resumes, with the
    /// region locked: they must not release, resume or remove it, nor add or remove
    /// companions. A callable takes the GIL: a thread that holds the GIL while it allocates
    /// in the tag (torch inside ``gpu_pager.torch.use(tag)``) during that tag's release or
    /// resume would wait for the region while the callable waits for the GIL, so do not
    /// allocate into a tag while it moves. Returns the identity ``remove_companion`` takes.
    #[pyo3(signature = (tag, name, before_release = None, after_resume = None))]
    fn add_companion(
        &self,
        py: Python<'_>,
        tag: &str,
        name: &str,
        before_release: Option<Py<PyAny>>,
        after_resume: Option<Py<PyAny>>,
    ) -> PyResult<u64> {
        for (what, f) in [
            ("before_release", &before_release),
            ("after_resume", &after_resume),
        ] {
            if let Some(f) = f
                && !f.bind(py).is_callable()
            {
                return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                    "{what} must be callable or None, not {}",
                    args::type_name(f.bind(py))
                )));
            }
        }
        let companion = std::sync::Arc::new(crate::companions::PyCompanion {
            name: name.to_owned(),
            before_release,
            after_resume,
        });
        let p = &self.inner;
        run(py, || p.add_companion(tag, companion))
    }

    /// Unregisters companion ``id`` (from ``add_companion``): it is not called again once
    /// this returns. ``InvalidArgumentError`` if there is no such companion.
    fn remove_companion(&self, py: Python<'_>, id: u64) -> PyResult<()> {
        let p = &self.inner;
        run(py, || p.remove_companion(id))
    }

    /// Removes region ``tag``: unmaps it, frees its backup and its address range; its
    /// buffers become stale. Refused (``BusyError``) while it is leased.
    fn remove(&self, py: Python<'_>, tag: &str) -> PyResult<()> {
        let p = &self.inner;
        run(py, || p.remove(tag))
    }

    /// The tags of all regions, in order.
    fn tags(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let p = &self.inner;
        run(py, || Ok(p.tags()))
    }

    /// The description of region ``tag``.
    fn info(&self, py: Python<'_>, tag: &str) -> PyResult<RegionInfo> {
        let p = &self.inner;
        run(py, || p.info(tag)).map(RegionInfo::from)
    }

    /// Allocates a buffer of ``nbytes`` in region ``tag``, aligned to ``align`` bytes (a
    /// power of two; default 256). Works whether the region is resident or released.
    #[pyo3(signature = (tag, nbytes, align = None))]
    fn alloc(
        &self,
        py: Python<'_>,
        tag: &str,
        nbytes: &Bound<'_, PyAny>,
        align: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Buffer> {
        let nbytes = args::size(nbytes, "nbytes")?;
        let align = align
            .map(|a| args::size(a, "align"))
            .transpose()?
            .unwrap_or(gpu_pager::DEFAULT_ALIGN);
        let p = &self.inner;
        let inner = run(py, || p.alloc_aligned(tag, nbytes, align))?;
        Ok(Buffer {
            inner,
            device: self.device,
        })
    }

    /// Frees a buffer. Freeing it twice is ``StaleBufferError``.
    fn free(&self, py: Python<'_>, buf: PyRef<'_, Buffer>) -> PyResult<()> {
        self.check_device(py, &buf)?;
        let (p, b) = (&self.inner, &buf.inner);
        run(py, || p.free(b))
    }

    /// The buffer's device address (an int). The address never changes, but it is backed
    /// by memory only while the region is resident: ``NotResidentError`` otherwise.
    fn ptr(&self, py: Python<'_>, buf: PyRef<'_, Buffer>) -> PyResult<u64> {
        self.check_device(py, &buf)?;
        let (p, b) = (&self.inner, &buf.inner);
        run(py, || p.ptr(b))
    }

    /// The live buffer whose bytes include device address ``ptr`` (an int, e.g. a torch
    /// tensor's ``data_ptr()``) and ``ptr``'s offset in it, as ``(buffer, offset)``; ``None``
    /// when no live buffer of this pager holds that address. Works while the region is
    /// released too.
    fn buffer_containing(&self, py: Python<'_>, ptr: u64) -> PyResult<Option<(Buffer, usize)>> {
        let (p, device) = (&self.inner, self.device);
        let found = run(py, || Ok(p.buffer_containing(ptr)))?;
        Ok(found.map(|(inner, offset)| (Buffer { inner, device }, offset)))
    }

    /// Copies ``data`` (bytes-like) into the buffer at ``offset``, through the pager: a
    /// released region is ``NotResidentError``, never a fault.
    fn write(
        &self,
        py: Python<'_>,
        buf: PyRef<'_, Buffer>,
        offset: &Bound<'_, PyAny>,
        data: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.check_device(py, &buf)?;
        let offset = args::size(offset, "offset")?;
        let data = args::data(data)?;
        let (p, b, d) = (&self.inner, &buf.inner, &*data);
        run(py, || p.write(b, offset, d))
    }

    /// Reads ``n`` bytes of the buffer from ``offset``, through the pager (a released region
    /// is ``NotResidentError``).
    fn read<'py>(
        &self,
        py: Python<'py>,
        buf: PyRef<'_, Buffer>,
        offset: &Bound<'_, PyAny>,
        n: &Bound<'_, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.read_with(py, &buf, offset, n, gpu_pager::Pager::read)
    }

    /// Marks (``on=True``) or unmarks bytes ``offset .. offset + length`` of the buffer
    /// (``length=None``: to the buffer's end) as **overwritten by the next update**: you
    /// promise to write every marked byte after the next resume before reading it, as a
    /// weight update does to the parameters. Mark one tensor inside a torch segment by its
    /// offset and size.
    ///
    /// A release of a ``PRESERVE`` region neither hashes nor copies the bytes marked at that
    /// moment, and the resume after it restores exactly what that release saved: marked
    /// bytes come back mapped and writable at the same addresses with undefined contents
    /// (their old values or anything else); every unmarked byte comes back bit-exact. A run
    /// of marked bytes shorter than 1 MiB between two saved spans may be copied along (one
    /// copy costs less than two). Marks stay across cycles until cleared (``on=False``) or
    /// the buffer is freed (a new buffer starts unmarked); clearing one makes the next
    /// release save those bytes again. A mark set while the region is released takes effect
    /// at the next release. Marks on ``DISCARD`` regions are accepted and change nothing.
    ///
    /// ``OutOfRangeError`` unless the range lies inside the buffer; ``StaleBufferError``
    /// for a freed buffer.
    #[pyo3(signature = (buf, on = true, offset = None, length = None))]
    fn set_overwritten(
        &self,
        py: Python<'_>,
        buf: PyRef<'_, Buffer>,
        on: bool,
        offset: Option<&Bound<'_, PyAny>>,
        length: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.check_device(py, &buf)?;
        let offset = offset.map_or(Ok(0), |o| args::size(o, "offset"))?;
        let length = length.map(|l| args::size(l, "length")).transpose()?;
        let (p, b) = (&self.inner, &buf.inner);
        run(py, || {
            let end = match length {
                Some(n) => offset.checked_add(n),
                None => Some(b.len().max(offset)),
            };
            let Some(end) = end else {
                return Err(gpu_pager::Error::OutOfRange {
                    tag: b.tag().to_owned(),
                    what: "buffer",
                    offset,
                    len: length.unwrap_or(0),
                    size: b.len(),
                });
            };
            p.set_overwritten(b, offset..end, on)
        })
    }

    /// The byte ranges of the buffer marked overwritten by the next update, as
    /// ``(start, end)`` offsets from the buffer's start, in order, merged where they touch
    /// (see ``set_overwritten``).
    fn overwritten(&self, py: Python<'_>, buf: PyRef<'_, Buffer>) -> PyResult<Vec<(usize, usize)>> {
        self.check_device(py, &buf)?;
        let (p, b) = (&self.inner, &buf.inner);
        let ranges = run(py, || p.overwritten(b))?;
        Ok(ranges.into_iter().map(|r| (r.start, r.end)).collect())
    }

    /// Reads ``n`` bytes of the buffer from ``offset`` out of its region's pinned host
    /// backup while the region is released: what the last release saved and the next resume
    /// restores, without mapping anything. ``InvalidArgumentError`` while the region is
    /// resident (read the device instead) or for bytes the backup does not hold (a
    /// ``DISCARD`` region, or bytes marked overwritten at the release).
    fn read_backup<'py>(
        &self,
        py: Python<'py>,
        buf: PyRef<'_, Buffer>,
        offset: &Bound<'_, PyAny>,
        n: &Bound<'_, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.read_with(py, &buf, offset, n, gpu_pager::Pager::read_backup)
    }

    /// Gives the physical memory of ``tags`` (a str or a sequence of str) back to the
    /// device: waits for outstanding device work, copies ``PRESERVE`` regions to their
    /// backups, unmapping each buffer as soon as its own copies are done. All or nothing for
    /// what it saves (``BusyError`` if one is leased; after a failed copy every region is
    /// resident again, its saved contents restored; a region whose contents it does not
    /// keep, a ``DISCARD`` region or one dropped, comes back as its resume would bring it).
    /// Regions already released are reported as such. ``drop`` (tags among ``tags``) drops
    /// those regions' contents for this cycle instead of backing them up: they come back
    /// zeroed at the next resume (a ``DISCARD`` region: undefined).
    #[pyo3(signature = (tags, drop = None))]
    fn release(
        &self,
        py: Python<'_>,
        tags: &Bound<'_, PyAny>,
        drop: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Report> {
        let tags = args::tags(tags)?;
        let drop = drop.map(args::tags).transpose()?.unwrap_or_default();
        let p = &self.inner;
        let options = gpu_pager::ReleaseOptions { drop };
        run(py, || p.release_with(&as_strs(&tags), &options)).map(Report::from)
    }

    /// Maps physical memory back under ``tags`` at the same addresses and restores
    /// ``PRESERVE`` contents bit-exact. All or nothing: on ``OutOfMemoryError`` every region
    /// stays released with its backup, and a later resume succeeds. ``"host"`` backups give
    /// their memory back after the restore unless ``keep_host_backups``.
    #[pyo3(signature = (tags, keep_host_backups = false))]
    fn resume(
        &self,
        py: Python<'_>,
        tags: &Bound<'_, PyAny>,
        keep_host_backups: bool,
    ) -> PyResult<Report> {
        let tags = args::tags(tags)?;
        let p = &self.inner;
        let options = gpu_pager::ResumeOptions { keep_host_backups };
        run(py, || p.resume_with(&as_strs(&tags), options)).map(Report::from)
    }

    /// ``resume`` that enqueues the restore copies on ``stream`` (an int ``CUstream`` or an
    /// object with ``.cuda_stream``, e.g. ``torch.cuda.Stream``) and returns once mapping is
    /// done: kernels launched next on that stream see the restored contents.
    fn resume_on(
        &self,
        py: Python<'_>,
        tags: &Bound<'_, PyAny>,
        stream: &Bound<'_, PyAny>,
    ) -> PyResult<Report> {
        let tags = args::tags(tags)?;
        let stream = args::stream(stream)?;
        let p = &self.inner;
        run(py, || p.resume_on(&as_strs(&tags), stream)).map(Report::from)
    }

    /// ``resume`` and ``lease`` in one step, so that no other thread can release the tags
    /// in between. Returns ``(report, lease)``.
    fn resume_and_lease(
        &self,
        py: Python<'_>,
        tags: &Bound<'_, PyAny>,
    ) -> PyResult<(Report, Lease)> {
        let tags = args::tags(tags)?;
        let p = &self.inner;
        let (report, lease) = run(py, || p.resume_and_lease(&as_strs(&tags)))?;
        Ok((Report::from(report), Lease::new(tags, lease)))
    }

    /// Keeps ``tags`` resident until the lease is closed: releasing one of them is
    /// ``BusyError`` meanwhile. ``NotResidentError`` if one is released now. Use it as a
    /// context manager (``with pager.lease("weights"): ...``) or call ``close()``.
    fn lease(&self, py: Python<'_>, tags: &Bound<'_, PyAny>) -> PyResult<Lease> {
        let tags = args::tags(tags)?;
        let p = &self.inner;
        let lease = run(py, || p.lease(&as_strs(&tags)))?;
        Ok(Lease::new(tags, lease))
    }

    /// Takes the failures no call could return (``Stats.deferred_errors``), oldest first.
    fn take_deferred_errors(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let p = &self.inner;
        run(py, || Ok(p.take_deferred_errors()))
    }

    /// Where the device's memory is now (an ``Audit``): each region's mapped, reserved and
    /// backed-up bytes and state, the device's use as the driver reports it, and what lies
    /// outside every region. ``gpu_pager.torch.audit()`` adds torch's memory outside the
    /// tags.
    fn audit(&self, py: Python<'_>) -> PyResult<crate::types::Audit> {
        let p = &self.inner;
        run(py, || p.audit()).map(crate::types::Audit::from)
    }

    /// Statistics of every region.
    fn stats(&self, py: Python<'_>) -> PyResult<Stats> {
        let p = &self.inner;
        run(py, || Ok(p.stats())).map(Stats::from)
    }

    /// Statistics of region ``tag``.
    fn region_stats(&self, py: Python<'_>, tag: &str) -> PyResult<RegionStats> {
        let p = &self.inner;
        run(py, || p.region_stats(tag)).map(RegionStats::from)
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PyPager>()
            .is_ok_and(|o| Arc::ptr_eq(&o.get().inner, &self.inner))
    }

    fn __hash__(&self) -> u64 {
        self.device as u64
    }

    fn __repr__(&self) -> String {
        format!(
            "Pager(device={}, backend={:?})",
            self.device,
            self.inner.backend_kind().to_string()
        )
    }
}

/// Keeps tags resident while open; see ``Pager.lease``. A context manager; ``close()`` (or
/// leaving the ``with`` block) ends it, and closing twice is harmless.
#[pyclass(module = "gpu_pager", frozen)]
pub struct Lease {
    tags: Vec<String>,
    inner: Mutex<Option<gpu_pager::Lease>>,
}

impl Lease {
    fn new(tags: Vec<String>, lease: gpu_pager::Lease) -> Self {
        Lease {
            tags,
            inner: Mutex::new(Some(lease)),
        }
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<gpu_pager::Lease>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl Lease {
    /// The leased tags, as given.
    #[getter]
    fn tags(&self) -> Vec<String> {
        self.tags.clone()
    }

    /// Whether the lease is still held.
    #[getter]
    fn active(&self) -> bool {
        self.slot().is_some()
    }

    /// Ends the lease (the tags may be released again).
    fn close(&self, py: Python<'_>) {
        let lease = self.slot().take();
        py.detach(move || drop(lease));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "Lease(tags={:?}, active={})",
            self.tags,
            if self.active() { "True" } else { "False" }
        )
    }
}
