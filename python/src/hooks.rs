//! What the torch integration and the drop-ins call below Python, through this module
//! rather than `ctypes`: the torch hooks' per-thread tag (`gpu_pager.torch`), and the
//! torch_memory_saver drop-in's model ([`gpu_pager_tms::tms`]). Each failure becomes the
//! exception of its error code, as every other call of the module ([`crate::args::run`]).

use std::path::PathBuf;

use pyo3::prelude::*;

use crate::args::run;

/// `PyBUF_WRITE` of CPython's `memoryobject.h` (a writable view; stable ABI since 3.3),
/// which pyo3-ffi declares only for 3.11+ under the limited API.
const PYBUF_WRITE: std::ffi::c_int = 0x200;

/// Registers the functions of this file in the extension module.
pub(crate) fn add_to(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(use_tag, m)?)?;
    m.add_function(wrap_pyfunction!(keep_forever, m)?)?;
    m.add_function(wrap_pyfunction!(tms_set_tag, m)?)?;
    m.add_function(wrap_pyfunction!(tms_tag, m)?)?;
    m.add_function(wrap_pyfunction!(tms_pause, m)?)?;
    m.add_function(wrap_pyfunction!(tms_resume, m)?)?;
    m.add_function(wrap_pyfunction!(tms_set_disk_dir, m)?)?;
    m.add_function(wrap_pyfunction!(tms_set_retain, m)?)?;
    m.add_function(wrap_pyfunction!(tms_retain, m)?)?;
    m.add_function(wrap_pyfunction!(tms_set_margin, m)?)?;
    m.add_function(wrap_pyfunction!(tms_backup_view, m)?)?;
    Ok(())
}

/// Sets (``None``: clears) the calling thread's tag for torch segments on ``device``.
#[pyfunction]
#[pyo3(name = "_use_tag")]
fn use_tag(py: Python<'_>, device: std::ffi::c_int, tag: Option<String>) -> PyResult<()> {
    // The tag is thread-local: the GIL is released on this same thread.
    run(py, || {
        let d = gpu_pager_capi::boundary::device(device)?;
        gpu_pager_capi::use_tag(d, tag.as_deref())
    })
}

/// Takes a reference to ``obj`` that is never given back, so that it outlives interpreter
/// shutdown (torch's pools and allocators, whose destruction at exit would free through a
/// library already unloading).
#[pyfunction]
#[pyo3(name = "_keep_forever")]
fn keep_forever(obj: Bound<'_, PyAny>) {
    std::mem::forget(obj.unbind());
}

/// torch_memory_saver's ``tms_set_current_tag`` for the calling thread.
#[pyfunction]
#[pyo3(name = "_tms_set_tag")]
fn tms_set_tag(py: Python<'_>, tag: String) -> PyResult<()> {
    run(py, || gpu_pager_tms::tms::set_tag(&tag))
}

/// The calling thread's drop-in tag.
#[pyfunction]
#[pyo3(name = "_tms_tag")]
fn tms_tag() -> String {
    gpu_pager_tms::tms::tag()
}

/// Pauses the drop-in's regions of ``tag`` (``None`` or empty: all).
#[pyfunction]
#[pyo3(name = "_tms_pause", signature = (tag = None))]
fn tms_pause(py: Python<'_>, tag: Option<String>) -> PyResult<()> {
    run(py, || gpu_pager_tms::tms::pause(tag.as_deref()))
}

/// Resumes the drop-in's regions of ``tag`` (``None`` or empty: all).
#[pyfunction]
#[pyo3(name = "_tms_resume", signature = (tag = None))]
fn tms_resume(py: Python<'_>, tag: Option<String>) -> PyResult<()> {
    run(py, || gpu_pager_tms::tms::resume(tag.as_deref()))
}

/// Sets the drop-in's disk backup directory.
#[pyfunction]
#[pyo3(name = "_tms_set_disk_dir")]
fn tms_set_disk_dir(py: Python<'_>, path: PathBuf) -> PyResult<()> {
    run(py, || gpu_pager_tms::tms::set_disk_dir(&path))
}

/// Whether the drop-in's resumes keep the CPU backups.
#[pyfunction]
#[pyo3(name = "_tms_set_retain")]
fn tms_set_retain(on: bool) {
    gpu_pager_tms::tms::set_retain(on);
}

/// See ``_tms_set_retain``.
#[pyfunction]
#[pyo3(name = "_tms_retain")]
fn tms_retain() -> bool {
    gpu_pager_tms::tms::retain()
}

/// torch_memory_saver's ``memory_margin_bytes``.
#[pyfunction]
#[pyo3(name = "_tms_set_margin")]
fn tms_set_margin(bytes: u64) {
    gpu_pager_tms::tms::set_margin(bytes);
}

/// A writable ``memoryview`` of the CPU backup of the ``nbytes`` device bytes at ``ptr``
/// while their region is paused (or resumed with its backup retained), else ``None``. It
/// views gpu-pager's memory: valid until the tag's next pause or non-retaining resume.
#[pyfunction]
#[pyo3(name = "_tms_backup_view")]
fn tms_backup_view(py: Python<'_>, ptr: u64, nbytes: usize) -> PyResult<Option<Py<PyAny>>> {
    let Some(host) = run(py, || gpu_pager_tms::tms::backup_pointer(ptr, nbytes))? else {
        return Ok(None);
    };
    let len = pyo3::ffi::Py_ssize_t::try_from(nbytes)
        .map_err(|_| pyo3::exceptions::PyOverflowError::new_err("nbytes is too large"))?;
    // SAFETY: `host` is the start of `nbytes` bytes of host memory that the pager keeps
    // until the region's next pause or non-retaining resume (the documented lifetime of the
    // view); the call copies nothing and returns a new reference or NULL with an exception.
    let view =
        unsafe { pyo3::ffi::PyMemoryView_FromMemory(host as usize as *mut _, len, PYBUF_WRITE) };
    // SAFETY: a new reference, or NULL with the exception set (taken by from_owned_ptr_or_err).
    Ok(Some(
        unsafe { Bound::from_owned_ptr_or_err(py, view) }?.unbind(),
    ))
}
