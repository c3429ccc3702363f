//! The one place where `crate::error::Error` becomes a Python exception.

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::error::Error;

create_exception!(
    _core,
    WireError,
    PyValueError,
    "A frame could not be decoded or a message could not be encoded."
);
create_exception!(
    _core,
    DetokenizerError,
    PyValueError,
    "The detokenizer was given something it cannot work with."
);

impl From<Error> for PyErr {
    fn from(err: Error) -> PyErr {
        match err {
            Error::Wire(e) => WireError::new_err(e.to_string()),
            Error::Detok(e) => DetokenizerError::new_err(e.to_string()),
            // Bad kernel arguments are the caller's bug, not a state of the engine.
            Error::Kernel(e) => PyValueError::new_err(e.to_string()),
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("WireError", py.get_type::<WireError>())?;
    m.add("DetokenizerError", py.get_type::<DetokenizerError>())?;
    Ok(())
}
