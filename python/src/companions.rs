//! Companions from Python: callables that move with a tag (`gpu_pager::Companion`).

use gpu_pager::{Companion, CompanionError};
use pyo3::prelude::*;

/// Two optional callables, each called with the tag.
pub(crate) struct PyCompanion {
    pub(crate) name: String,
    pub(crate) before_release: Option<Py<PyAny>>,
    pub(crate) after_resume: Option<Py<PyAny>>,
}

impl PyCompanion {
    /// Calls `f(tag)` holding the GIL (the pager's call released it); an exception is the
    /// companion's failure, shown as `Type: message`.
    fn run(&self, f: &Option<Py<PyAny>>, tag: &str) -> Result<(), CompanionError> {
        let Some(f) = f else { return Ok(()) };
        Python::attach(|py| {
            f.call1(py, (tag,)).map(drop).map_err(|e| {
                let kind = e
                    .get_type(py)
                    .name()
                    .map_or_else(|_| "Exception".to_owned(), |n| n.to_string());
                format!("{kind}: {}", e.value(py)).into()
            })
        })
    }
}

impl Companion for PyCompanion {
    fn name(&self) -> &str {
        &self.name
    }
    fn before_release(&self, tag: &str) -> Result<(), CompanionError> {
        self.run(&self.before_release, tag)
    }
    fn after_resume(&self, tag: &str) -> Result<(), CompanionError> {
        self.run(&self.after_resume, tag)
    }
}
