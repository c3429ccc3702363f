//! Dynamic values (utility call arguments and results) <-> plain Python objects:
//! None, bool, int, float, str, bytes, list (tuples become lists), dict with
//! str keys.

use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple,
};

use super::extract::bad;
use crate::protocol::{Value, WireError, MAX_VALUE_DEPTH};

pub fn value_from_py(obj: &Bound<'_, PyAny>, path: &str) -> Result<Value, WireError> {
    from_py(obj, path, 0)
}

fn from_py(obj: &Bound<'_, PyAny>, path: &str, depth: usize) -> Result<Value, WireError> {
    if obj.is_none() {
        return Ok(Value::Nil);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        if let Ok(v) = obj.extract::<u64>() {
            return Ok(Value::UInt(v));
        }
        if let Ok(v) = obj.extract::<i64>() {
            return Ok(Value::Int(v));
        }
        return Err(bad(|| path.to_string(), "an int in -2^63..2^64", obj));
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(Value::Float(f.value()));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        let s = s
            .to_str()
            .map_err(|_| bad(|| path.to_string(), "a str encodable as UTF-8", obj))?;
        return Ok(Value::Str(s.to_string()));
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(Value::Bytes(b.as_bytes().to_vec()));
    }
    if let Ok(b) = obj.cast::<PyByteArray>() {
        return Ok(Value::Bytes(b.to_vec()));
    }
    let nested = obj.is_instance_of::<PyList>()
        || obj.is_instance_of::<PyTuple>()
        || obj.is_instance_of::<PyDict>();
    if nested && depth >= MAX_VALUE_DEPTH {
        return Err(WireError::encode(
            path,
            format!("lists and maps nest deeper than {MAX_VALUE_DEPTH} levels"),
        ));
    }
    if let Ok(list) = obj.cast::<PyList>() {
        return list
            .iter()
            .map(|item| from_py(&item, path, depth + 1))
            .collect::<Result<_, _>>()
            .map(Value::List);
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return tuple
            .iter()
            .map(|item| from_py(&item, path, depth + 1))
            .collect::<Result<_, _>>()
            .map(Value::List);
    }
    if let Ok(dict) = obj.cast::<PyDict>() {
        let mut entries = Vec::with_capacity(dict.len());
        for (key, item) in dict.iter() {
            let Ok(key) = key.cast::<PyString>() else {
                return Err(bad(|| path.to_string(), "str dict keys", &key));
            };
            let key = key.to_str().map_err(|_| {
                bad(
                    || path.to_string(),
                    "a str encodable as UTF-8",
                    key.as_any(),
                )
            })?;
            entries.push((key.to_string(), from_py(&item, path, depth + 1)?));
        }
        return Ok(Value::Map(entries));
    }
    Err(bad(
        || path.to_string(),
        "None, bool, int, float, str, bytes, list, tuple or dict",
        obj,
    ))
}

pub fn value_to_py<'py>(py: Python<'py>, value: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Value::Nil => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Value::Int(i) => i.into_pyobject(py)?.into_any(),
        Value::UInt(u) => u.into_pyobject(py)?.into_any(),
        Value::Float(f) => PyFloat::new(py, *f).into_any(),
        Value::Str(s) => PyString::new(py, s).into_any(),
        Value::Bytes(b) => PyBytes::new(py, b).into_any(),
        Value::List(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(value_to_py(py, item)?)?;
            }
            list.into_any()
        }
        Value::Map(entries) => {
            let dict = PyDict::new(py);
            for (key, item) in entries {
                dict.set_item(key, value_to_py(py, item)?)?;
            }
            dict.into_any()
        }
    })
}
