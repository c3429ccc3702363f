//! Python values of the compound request-field kinds (`protocol::kinds` says
//! how they travel), for the generated `add_request.rs`: extracted with the GIL
//! held into owned Rust values, and back into Python objects for the getters.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::classes::wire_err;
use super::extract;
use crate::protocol::{StructuredSpec, WireError};

/// A `{token id: bias}` mapping (any object with `items()`, or an iterable of
/// `(id, bias)` pairs) as pairs sorted by id; a repeated id is an error.
pub fn token_bias(
    obj: &Bound<'_, PyAny>,
    path: &dyn Fn() -> String,
) -> Result<Vec<(u32, f32)>, WireError> {
    let pairs = match obj.call_method0("items") {
        Ok(items) => items,
        Err(_) => obj.clone(),
    };
    let mut out = Vec::new();
    extract::for_each(&pairs, path, |i, pair| {
        let at = || format!("{}[{i}]", path());
        let (id, bias): (Bound<'_, PyAny>, Bound<'_, PyAny>) = pair
            .extract()
            .map_err(|_| extract::bad(at, "a (token id, bias) pair", pair))?;
        let id = extract::u32_(&id, at)?;
        let bias = extract::f64_(&bias, at)? as f32;
        out.push((id, bias));
        Ok(())
    })?;
    out.sort_by_key(|p| p.0);
    if let Some(w) = out.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(WireError::encode(
            path(),
            format!("token id {} is given twice", w[0].0),
        ));
    }
    Ok(out)
}

/// A sequence of token-id sequences.
pub fn u32_lists(
    obj: &Bound<'_, PyAny>,
    path: &dyn Fn() -> String,
) -> Result<Vec<Vec<u32>>, WireError> {
    let mut out = Vec::new();
    extract::for_each(obj, path, |i, list| {
        out.push(extract::u32s(list, &|| format!("{}[{i}]", path()))?);
        Ok(())
    })?;
    Ok(out)
}

/// A `(kind, spec)` output constraint, checked as the wire will.
pub fn structured(spec: Option<(String, String)>, path: &str) -> PyResult<Option<StructuredSpec>> {
    let Some((kind, spec)) = spec else {
        return Ok(None);
    };
    let s = StructuredSpec { kind, spec };
    s.check()
        .map_err(|e| wire_err(WireError::encode(path, e)))?;
    Ok(Some(s))
}

pub fn token_bias_dict<'py>(py: Python<'py>, bias: &[(u32, f32)]) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for &(id, b) in bias {
        d.set_item(id, f64::from(b))?;
    }
    Ok(d)
}

pub fn u32_lists_list<'py>(py: Python<'py>, lists: &[Vec<u32>]) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for l in lists {
        out.append(PyList::new(py, l)?)?;
    }
    Ok(out)
}
