//! `gpu_pager._native`, the extension module of the `gpu_pager` Python package: PyO3
//! bindings of [`gpu_pager`] (abi3, CPython >= 3.9). The Python package re-exports
//! everything from here; see `python/gpu_pager/_native.pyi` for the Python API.
//!
//! The binding wraps the core's types (no PyO3 attributes on them), maps every
//! [`gpu_pager::Error`] to the exception class of its [`gpu_pager::ErrorCode`], releases the
//! GIL around every call that takes a pager lock, and lets no panic cross into Python.
//!
//! The module also carries the whole C ABI ([`gpu_pager_capi`], re-exported below), torch's
//! allocator hooks (`gpu_pager_torch_malloc`/`gpu_pager_torch_free`/`gpu_pager_use_tag`)
//! included: `gpu_pager.torch` hands torch this module's own path, so Python, torch and any
//! C caller in the process share one copy of the library and one pager per device. It also
//! carries the drop-in wing's C functions ([`gpu_pager_tms`], `include/gpu_pager_tms.h`)
//! for the preload library. Python reaches both through PyO3 functions (`hooks`), never
//! through `ctypes`.

use pyo3::prelude::*;

/// The C ABI, exported by the extension module itself (see the module docs).
pub use gpu_pager_capi::*;
/// The drop-in wing's C functions (`gpu_pager_tms_*`), which the preload library looks up
/// in this module.
pub use gpu_pager_tms::tms::{gpu_pager_tms_cuda_free, gpu_pager_tms_cuda_malloc};

mod args;
mod companions;
mod errors;
mod hooks;
mod pager;
mod types;

/// The extension module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::add_to(m)?;
    // gpu-pager's log records (info and above) go to `logging` after each call; the
    // extension is the only Rust code of the process, so no other logger competes.
    let _ = gpu_pager_capi::queue_records(3);
    m.add_function(wrap_pyfunction!(errors::error_codes, m)?)?;
    m.add_function(wrap_pyfunction!(errors::error, m)?)?;
    m.add_function(wrap_pyfunction!(torch_hook_state, m)?)?;
    hooks::add_to(m)?;
    m.add_class::<pager::PyPager>()?;
    m.add_class::<pager::Lease>()?;
    m.add_class::<types::Policy>()?;
    m.add_class::<types::State>()?;
    m.add_function(wrap_pyfunction!(pager::configure, m)?)?;
    m.add_function(wrap_pyfunction!(pager::settings, m)?)?;
    m.add_class::<types::Config>()?;
    m.add_class::<types::Audit>()?;
    m.add_class::<types::AuditRegion>()?;
    m.add_class::<types::RegionInfo>()?;
    m.add_class::<types::Buffer>()?;
    m.add_class::<types::Steps>()?;
    m.add_class::<types::RegionReport>()?;
    m.add_class::<types::Report>()?;
    m.add_class::<types::RegionStats>()?;
    m.add_class::<types::Stats>()?;
    m.add("DEFAULT_ALIGN", gpu_pager::DEFAULT_ALIGN)?;
    m.add("POISON", gpu_pager::POISON)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

/// The state of the torch allocator hooks on `device`, for the calling thread:
/// ``(tag, last_error)``: the tag new segments come from (or ``None``) and the message of
/// the thread's last failed C call (a torch hook's included), or ``None``.
#[pyfunction]
#[pyo3(name = "_torch_hook_state")]
fn torch_hook_state(device: usize) -> (Option<String>, Option<String>) {
    (
        gpu_pager_capi::current_tag(device),
        gpu_pager_capi::last_error(),
    )
}
