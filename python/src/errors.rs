//! The exception tree: `gpu_pager.PagerError` and one subclass per [`ErrorCode`], named
//! `<Name>Error` after [`ErrorCode::name`]. The classes are built at import time from
//! [`ErrorCode::ALL`], the one table shared with the C ABI, so a new code gets its class
//! without a change here (and `doc` below stops compiling until it gets a docstring).

use std::any::Any;

use gpu_pager::ErrorCode;
use pyo3::exceptions::{PyMemoryError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

/// The classes, created once per process by [`add_to`].
struct Classes {
    base: Py<PyType>,
    /// In the order of [`ErrorCode::ALL`].
    by_code: Vec<(ErrorCode, Py<PyType>)>,
}

static CLASSES: PyOnceLock<Classes> = PyOnceLock::new();

/// The Python class name of `code`: `NotResident` → `NotResidentError`.
pub(crate) fn class_name(code: ErrorCode) -> String {
    format!("{code}Error")
}

/// The docstring of `code`'s class.
fn doc(code: ErrorCode) -> &'static str {
    match code {
        ErrorCode::NotResident => {
            "The region is released; the operation needs it resident. Resume it first."
        }
        ErrorCode::NotBacked => {
            "A range of an elastic region has no physical memory mapped (never backed, or trimmed)."
        }
        ErrorCode::UnknownTag => "No region has this tag (the message suggests the nearest one).",
        ErrorCode::Busy => "The region is held resident by leases and cannot be released now.",
        ErrorCode::OutOfMemory => {
            "The device has too little free memory for the step (resume, region creation, back). \
             Nothing was lost; retry once the memory is free. Also a MemoryError."
        }
        ErrorCode::InvalidSize => "A size was zero, too large, or not acceptable here.",
        ErrorCode::OutOfRange => "An access outside a buffer or region.",
        ErrorCode::StaleBuffer => {
            "The buffer is not (or no longer) allocated in its region: freed already, or from \
             another pager."
        }
        ErrorCode::RegionFull => "The region has no free range large enough for the allocation.",
        ErrorCode::TagConflict => {
            "The tag exists with another policy, size or option than the one asked for."
        }
        ErrorCode::Corrupted => {
            "Restored contents differ from the backup (verify_restore); the region stays released."
        }
        ErrorCode::BackupInUse => {
            "The backup holds the region's contents while it is released and cannot be freed."
        }
        ErrorCode::InvalidArgument => "An argument other than a size is not acceptable.",
        ErrorCode::Kv => "A paged-KV-cache call was refused; nothing was changed.",
        ErrorCode::Backend => "The device driver or the operating system failed.",
        ErrorCode::Internal => {
            "A bug: an invariant of gpu-pager failed (never the caller's input). Please report \
             it with the message."
        }
        ErrorCode::Companion => {
            "A companion of the region (Pager.add_companion) failed while it moved; the release \
             or resume was undone and every region is as before the call."
        }
        ErrorCode::Panic => {
            "A bug: gpu-pager panicked inside the call and the binding caught it. Please report \
             it with the message."
        }
    }
}

const BASE_DOC: &str = "Base class of every error gpu_pager raises; a ``RuntimeError``.\n\n\
    Attributes: ``tag`` (the region the error concerns, ``None`` when none applies), \
    ``tags`` (every region it concerns: one for most errors, none or several for a driver \
    failure that served a whole release or resume), \
    ``code`` (the stable error number, as the C ABI returns it; also a class attribute) and \
    the message (``str(err)``), which says what to do about it.";

fn new_class<'py>(
    py: Python<'py>,
    name: &str,
    bases: Bound<'py, PyTuple>,
    doc: &str,
    code: Option<u32>,
) -> PyResult<Py<PyType>> {
    let dict = PyDict::new(py);
    dict.set_item("__module__", "gpu_pager")?;
    dict.set_item("__doc__", doc)?;
    // Class-level defaults for instances made by hand; the base class has no code.
    if let Some(code) = code {
        dict.set_item("code", code)?;
    }
    dict.set_item("tag", py.None())?;
    dict.set_item("tags", pyo3::types::PyList::empty(py))?;
    let cls = py.get_type::<PyType>().call1((name, bases, dict))?;
    Ok(cls.cast_into::<PyType>()?.unbind())
}

fn build(py: Python<'_>) -> PyResult<Classes> {
    let base = new_class(
        py,
        "PagerError",
        // A RuntimeError, as the CUDA errors of torch and vLLM are: callers that catch
        // those catch ours.
        PyTuple::new(py, [py.get_type::<PyRuntimeError>()])?,
        BASE_DOC,
        None,
    )?;
    let mut by_code = Vec::with_capacity(ErrorCode::ALL.len());
    for code in ErrorCode::ALL {
        let mut bases = vec![base.bind(py).clone()];
        if code == ErrorCode::OutOfMemory {
            // `except MemoryError` in generic code sees a device that ran out of memory too.
            bases.push(py.get_type::<PyMemoryError>());
        }
        let cls = new_class(
            py,
            &class_name(code),
            PyTuple::new(py, bases)?,
            doc(code),
            Some(code.number()),
        )?;
        by_code.push((code, cls));
    }
    Ok(Classes { base, by_code })
}

/// Creates the classes (once per process) and adds them to module `m`.
pub(crate) fn add_to(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let classes = CLASSES.get_or_try_init(py, || build(py))?;
    m.add("PagerError", classes.base.bind(py))?;
    for (code, cls) in &classes.by_code {
        m.add(class_name(*code).as_str(), cls.bind(py))?;
    }
    Ok(())
}

/// Every error code as ``(number, name)``, in the order of the table; the class of
/// ``name`` is ``<name>Error``.
#[pyfunction]
pub(crate) fn error_codes() -> Vec<(u32, String)> {
    ErrorCode::ALL
        .into_iter()
        .map(|c| (c.number(), c.to_string()))
        .collect()
}

/// An instance of `code`'s class with `tag`, `code` and `message`.
fn new_err(py: Python<'_>, code: ErrorCode, tags: &[&str], message: String) -> PyErr {
    let Some(classes) = CLASSES.get(py) else {
        return PyRuntimeError::new_err(format!("gpu_pager is not initialised: {message}"));
    };
    let Some((_, cls)) = classes.by_code.iter().find(|(c, _)| *c == code) else {
        return PyRuntimeError::new_err(format!("gpu_pager: no class for {code}: {message}"));
    };
    let made = cls.bind(py).call1((message,)).and_then(|err| {
        err.setattr("tag", tags.first())?;
        err.setattr("tags", tags.to_vec())?;
        err.setattr("code", code.number())?;
        Ok(err)
    });
    match made {
        Ok(err) => PyErr::from_value(err),
        Err(e) => e,
    }
}

/// The exception of error number `code` (as the C ABI returns it; an unknown number is
/// `InvalidArgumentError`'s) with `message` and the regions `tags`: how the package's Python
/// code raises what a C call or a check of its own reports, as the pager raises its errors.
#[pyfunction]
#[pyo3(name = "_error", signature = (code, message, tags = Vec::new()))]
pub(crate) fn error(py: Python<'_>, code: u32, message: String, tags: Vec<String>) -> Py<PyAny> {
    let code = ErrorCode::from_number(code).unwrap_or(ErrorCode::InvalidArgument);
    let tags: Vec<&str> = tags.iter().map(String::as_str).collect();
    new_err(py, code, &tags, message).into_value(py).into_any()
}

/// The Python exception for a pager error (its class is chosen by [`gpu_pager::Error::code`],
/// an exhaustive match in the core).
pub(crate) fn to_py(py: Python<'_>, e: &gpu_pager::Error) -> PyErr {
    new_err(py, e.code(), &e.tags(), e.to_string())
}

/// `PanicError` for a panic caught at the boundary.
pub(crate) fn panic(py: Python<'_>, payload: Box<dyn Any + Send>) -> PyErr {
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_owned());
    new_err(
        py,
        ErrorCode::Panic,
        &[],
        format!("gpu-pager panicked: {what}; this is a bug, please report it"),
    )
}
