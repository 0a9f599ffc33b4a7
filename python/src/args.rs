//! Python arguments to Rust values: wrong Python types are `TypeError`, values no pager
//! could accept (a negative size, an unknown policy name) are `ValueError`; everything else
//! is left to the pager to answer with its own errors.

use std::borrow::Cow;
use std::panic::{AssertUnwindSafe, catch_unwind};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyDict, PyInt, PyString};

use crate::errors;
use crate::types::Policy;

/// Runs `f` with the GIL released and any panic caught, and turns a pager error into its
/// exception.
pub(crate) fn run<T, F>(py: Python<'_>, f: F) -> PyResult<T>
where
    T: Send,
    F: FnOnce() -> gpu_pager::Result<T> + Send,
{
    let out = match py.detach(|| catch_unwind(AssertUnwindSafe(f))) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(errors::to_py(py, &e)),
        Err(payload) => Err(errors::panic(py, payload)),
    };
    forward_logs(py);
    out
}

/// Hands the log records gpu-pager kept since the last call (any thread's) to Python's
/// `logging`, logger `"gpu_pager"`, on this thread with the GIL held; a record's data (the
/// release warning's `event`, `device`, `outside_bytes`) is the `gpu_pager` attribute of
/// the `logging` record, a dict of str. A failure of `logging`
/// itself is dropped: a log record must not fail the call.
pub(crate) fn forward_logs(py: Python<'_>) {
    let records = gpu_pager_capi::take_records();
    if records.is_empty() {
        return;
    }
    let Ok(logger) = py
        .import("logging")
        .and_then(|m| m.call_method1("getLogger", ("gpu_pager",)))
    else {
        return;
    };
    for record in records {
        // log's levels (1 error … 5 trace) as logging's (40 … 5).
        let py_level = match record.level {
            1 => 40,
            2 => 30,
            3 => 20,
            4 => 10,
            _ => 5,
        };
        // The record's data, as `record.gpu_pager` (a dict of str), for filters.
        let extra = PyDict::new(py);
        if !record.fields.is_empty() {
            let fields = PyDict::new(py);
            for (k, v) in &record.fields {
                let _ = fields.set_item(k, v);
            }
            let _ = extra.set_item("gpu_pager", fields);
        }
        let kwargs = PyDict::new(py);
        let _ = kwargs.set_item("extra", extra);
        let _ = logger.call_method("log", (py_level, record.message), Some(&kwargs));
    }
}

/// A tag set: one `str`, or an iterable of `str`.
pub(crate) fn tags(obj: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(vec![s.to_cow()?.into_owned()]);
    }
    let bad = || {
        PyTypeError::new_err(format!(
            "tags must be a str or a sequence of str, not {}",
            type_name(obj)
        ))
    };
    if obj.is_instance_of::<PyBytes>() || obj.is_instance_of::<PyByteArray>() {
        return Err(bad());
    }
    let iter = obj.try_iter().map_err(|_| bad())?;
    let mut out = Vec::new();
    for item in iter {
        let item = item?;
        let s = item.cast::<PyString>().map_err(|_| {
            PyTypeError::new_err(format!(
                "each tag must be a str, not {}",
                type_name(item.as_any())
            ))
        })?;
        out.push(s.to_cow()?.into_owned());
    }
    Ok(out)
}

/// `&[&str]` view of [`tags`]'s result, for the pager's calls.
pub(crate) fn as_strs(tags: &[String]) -> Vec<&str> {
    tags.iter().map(String::as_str).collect()
}

/// A byte count or offset: a Python int (not a bool) `>= 0`.
pub(crate) fn size(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    if obj.is_instance_of::<PyBool>() || !obj.is_instance_of::<PyInt>() {
        return Err(PyTypeError::new_err(format!(
            "{what} must be an int, not {}",
            type_name(obj)
        )));
    }
    // Any int past usize (2^64 or 2^200 alike) is the same ValueError.
    obj.extract::<usize>().map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be between 0 and {}, not {}",
            usize::MAX,
            obj.str().map_or_else(|_| "that".into(), |s| s.to_string())
        ))
    })
}

/// A policy: a [`Policy`] member or its name (`"preserve"`, `"discard"`,
/// `"discard_zeroed"`).
pub(crate) fn policy(obj: &Bound<'_, PyAny>) -> PyResult<gpu_pager::Policy> {
    if let Ok(p) = obj.cast::<Policy>() {
        return Ok(p.get().core());
    }
    let s = obj.cast::<PyString>().map_err(|_| {
        PyTypeError::new_err(format!(
            "policy must be a gpu_pager.Policy or one of \"preserve\", \"discard\", \
             \"discard_zeroed\", not {}",
            type_name(obj)
        ))
    })?;
    let s = s.to_cow()?;
    Policy::from_name(&s).map(Policy::core).ok_or_else(|| {
        PyValueError::new_err(format!(
            "unknown policy {s:?}: use \"preserve\", \"discard\" or \"discard_zeroed\""
        ))
    })
}

/// A backup medium by name: `"pinned"`, `"host"` or `"file"`.
pub(crate) fn medium(name: &str) -> PyResult<gpu_pager::Medium> {
    gpu_pager::Medium::from_name(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "unknown backup medium {name:?}: use \"pinned\" (kept across cycles), \"host\" \
             (given back after each resume) or \"file\" (in the backup directory)"
        ))
    })
}

/// A copy route by name: `"engine"`, `"kernel"` or `"fastest"`.
pub(crate) fn route(name: &str, what: &str) -> PyResult<gpu_pager::CopyRoute> {
    gpu_pager::CopyRoute::from_name(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "unknown {what} {name:?}: use \"engine\" (the copy engine, leaving the SMs to \
             the application), \"kernel\" (the copy kernel) or \"fastest\" (whichever the \
             first 64 MiB of a copy shows faster)"
        ))
    })
}

/// A value for `setting` from a Python object: an int for a byte count, a bool for a
/// switch, a route's name for a route.
pub(crate) fn setting(
    obj: &Bound<'_, PyAny>,
    setting: &gpu_pager::Setting,
) -> PyResult<gpu_pager::SettingValue> {
    let name = setting.name;
    Ok(match setting.kind {
        gpu_pager::SettingKind::Bytes => gpu_pager::SettingValue::Bytes(size(obj, name)?),
        gpu_pager::SettingKind::Switch => match obj.cast::<PyBool>() {
            Ok(b) => gpu_pager::SettingValue::Switch(b.is_true()),
            Err(_) => {
                return Err(PyTypeError::new_err(format!(
                    "{name} must be a bool, not {}",
                    type_name(obj)
                )));
            }
        },
        gpu_pager::SettingKind::Route => {
            let text = obj.cast::<PyString>().map_err(|_| {
                PyTypeError::new_err(format!("{name} must be a str, not {}", type_name(obj)))
            })?;
            gpu_pager::SettingValue::Route(route(&text.to_cow()?, name)?)
        }
    })
}

/// A region kind by name: `"fixed"` or `"growing"` (elastic regions are the Rust KV
/// cache's, which Python does not offer).
pub(crate) fn region_kind(name: &str) -> PyResult<gpu_pager::RegionKind> {
    gpu_pager::RegionKind::from_name(name)
        .filter(|k| *k != gpu_pager::RegionKind::Elastic)
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "unknown region kind {name:?}: use \"fixed\" (all its bytes mapped while \
                 resident) or \"growing\" (memory mapped only under its buffers)"
            ))
        })
}

/// A CUDA stream: an int (`CUstream`, 0 is the legacy default stream) or an object with
/// an int `.cuda_stream` attribute (`torch.cuda.Stream`).
pub(crate) fn stream(obj: &Bound<'_, PyAny>) -> PyResult<gpu_pager::backend::RawStream> {
    let raw = if obj.is_instance_of::<PyInt>() {
        obj.clone()
    } else {
        obj.getattr("cuda_stream").map_err(|_| {
            PyTypeError::new_err(format!(
                "stream must be an int (a CUstream) or have a .cuda_stream attribute \
                 (torch.cuda.Stream), not {}",
                type_name(obj)
            ))
        })?
    };
    Ok(gpu_pager::backend::RawStream(size(&raw, "stream")?))
}

/// The bytes of a bytes-like object (anything with the buffer protocol), borrowed from
/// `bytes` and copied otherwise.
pub(crate) fn data<'a>(obj: &'a Bound<'_, PyAny>) -> PyResult<Cow<'a, [u8]>> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(Cow::Borrowed(b.as_bytes()));
    }
    if obj.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(
            "data must be bytes-like, not str (encode it first)",
        ));
    }
    // The limited API of Python 3.9 has no buffer protocol: `bytes(memoryview(obj))` copies
    // from any buffer exporter (bytearray, memoryview, array, numpy) and refuses the rest.
    let py = obj.py();
    let view = py
        .import("builtins")?
        .getattr("memoryview")?
        .call1((obj,))
        .map_err(|_| {
            PyTypeError::new_err(format!(
                "data must be bytes-like (bytes, bytearray, memoryview, ...), not {}",
                type_name(obj)
            ))
        })?;
    let bytes = py.get_type::<PyBytes>().call1((view,))?;
    let bytes = bytes.cast_into::<PyBytes>()?;
    Ok(Cow::Owned(bytes.as_bytes().to_vec()))
}

/// The name of `obj`'s type, for messages.
pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |n| n.to_string())
}
