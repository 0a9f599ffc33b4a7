//! `gpu_pager._native`, the extension module of the `gpu_pager` Python package: PyO3
//! bindings of [`gpu_pager`] (abi3, CPython >= 3.9). The Python package re-exports
//! everything from here; see `python/gpu_pager/_native.pyi` for the Python API.
//!
//! The binding wraps the core's types (no PyO3 attributes on them), maps every
//! [`gpu_pager::Error`] to the exception class of its [`gpu_pager::ErrorCode`], releases the
//! GIL around every call that takes a pager lock, and lets no panic cross into Python.

use pyo3::prelude::*;

mod args;
mod errors;
mod pager;
mod registry;
mod torch;
mod types;

/// The extension module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::add_to(m)?;
    m.add_function(wrap_pyfunction!(errors::error_codes, m)?)?;
    m.add_function(wrap_pyfunction!(torch_hook_state, m)?)?;
    m.add_class::<pager::PyPager>()?;
    m.add_class::<pager::Lease>()?;
    m.add_class::<types::Policy>()?;
    m.add_class::<types::State>()?;
    m.add_class::<types::RegionInfo>()?;
    m.add_class::<types::Buffer>()?;
    m.add_class::<types::Steps>()?;
    m.add_class::<types::RegionReport>()?;
    m.add_class::<types::Report>()?;
    m.add_class::<types::RegionStats>()?;
    m.add_class::<types::Stats>()?;
    m.add("DEFAULT_ALIGN", gpu_pager::DEFAULT_ALIGN)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

/// The state of the torch allocator hooks on `device`, for the calling thread:
/// ``(tag, last_error, segments, segment_bytes)``: the tag new segments come from (or
/// ``None``), the message of the thread's last failed hook call, and
/// the live segments of the device with their bytes.
#[pyfunction]
#[pyo3(name = "_torch_hook_state")]
fn torch_hook_state(device: usize) -> (Option<String>, Option<String>, usize, usize) {
    let (n, bytes) = torch::segments(device);
    (torch::current_tag(device), torch::last_error(), n, bytes)
}
