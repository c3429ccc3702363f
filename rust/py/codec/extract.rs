//! Python objects -> owned Rust values, with the GIL held. Fast paths for lists
//! and tuples of ints/floats and for buffers (numpy arrays, `array.array`);
//! anything else iterable works too, more slowly. Failures are `WireError`s that
//! name the argument and the element.

use std::ptr::addr_of_mut;

use pyo3::buffer::PyBuffer;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::protocol::{FinishReason, WireError};

/// A short description of `obj` for error messages: its type and a clipped repr.
#[cold]
pub fn describe(obj: &Bound<'_, PyAny>) -> String {
    let type_name = obj
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into());
    let mut repr = obj.repr().map(|r| r.to_string()).unwrap_or_default();
    if repr.chars().count() > 40 {
        repr = repr.chars().take(37).collect::<String>() + "...";
    }
    format!("{type_name} {repr}")
}

#[cold]
pub fn bad(path: impl FnOnce() -> String, expected: &str, obj: &Bound<'_, PyAny>) -> WireError {
    WireError::encode(
        path(),
        format!("expected {expected}, got {}", describe(obj)),
    )
}

#[inline]
pub fn int<T>(
    obj: &Bound<'_, PyAny>,
    path: impl FnOnce() -> String,
    range: &str,
) -> Result<T, WireError>
where
    T: for<'a, 'py> FromPyObject<'a, 'py>,
{
    // Anything with `__index__` (numpy integers too), but not a bool.
    if obj.is_instance_of::<PyBool>() {
        return Err(bad(path, &format!("an int in {range}"), obj));
    }
    obj.extract::<T>()
        .map_err(|_| bad(path, &format!("an int in {range}"), obj))
}

#[inline]
pub fn u64_(obj: &Bound<'_, PyAny>, path: impl FnOnce() -> String) -> Result<u64, WireError> {
    int(obj, path, "0..2^64")
}

#[inline]
pub fn u32_(obj: &Bound<'_, PyAny>, path: impl FnOnce() -> String) -> Result<u32, WireError> {
    int(obj, path, "0..2^32")
}

pub fn f64_(obj: &Bound<'_, PyAny>, path: impl FnOnce() -> String) -> Result<f64, WireError> {
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(f.value());
    }
    if obj.is_instance_of::<PyInt>() && !obj.is_instance_of::<PyBool>() {
        if let Ok(v) = obj.extract::<f64>() {
            return Ok(v);
        }
    }
    Err(bad(path, "a float", obj))
}

pub fn str_(obj: &Bound<'_, PyAny>, path: impl FnOnce() -> String) -> Result<String, WireError> {
    match obj.cast::<PyString>() {
        Ok(s) => s
            .to_str()
            .map(str::to_string)
            .map_err(|_| bad(path, "a str encodable as UTF-8", obj)),
        Err(_) => Err(bad(path, "a str", obj)),
    }
}

/// `None` or `T`.
pub fn opt<'py, T>(
    obj: &Bound<'py, PyAny>,
    read: impl FnOnce(&Bound<'py, PyAny>) -> Result<T, WireError>,
) -> Result<Option<T>, WireError> {
    if obj.is_none() {
        Ok(None)
    } else {
        read(obj).map(Some)
    }
}

pub fn finish_reason(
    obj: &Bound<'_, PyAny>,
    path: impl Fn() -> String,
) -> Result<FinishReason, WireError> {
    let expected = "'stop', 'length', 'abort' or 'error'";
    let s = obj
        .cast::<PyString>()
        .map_err(|_| bad(&path, expected, obj))?;
    s.to_str()
        .ok()
        .and_then(FinishReason::from_name)
        .ok_or_else(|| bad(&path, expected, obj))
}

/// Runs `each` on every item of a list, a tuple or another iterable, with
/// the item's index.
pub fn for_each<'py>(
    obj: &Bound<'py, PyAny>,
    path: &dyn Fn() -> String,
    mut each: impl FnMut(usize, &Bound<'py, PyAny>) -> Result<(), WireError>,
) -> Result<(), WireError> {
    if let Ok(list) = obj.cast::<PyList>() {
        for (i, item) in list.iter().enumerate() {
            each(i, &item)?;
        }
    } else if let Ok(tuple) = obj.cast::<PyTuple>() {
        for (i, item) in tuple.iter().enumerate() {
            each(i, &item)?;
        }
    } else if obj.is_instance_of::<PyString>() {
        return Err(bad(path, "a sequence", obj));
    } else {
        let iter = obj.try_iter().map_err(|_| bad(path, "a sequence", obj))?;
        for (i, item) in iter.enumerate() {
            let item = item.map_err(|e| WireError::encode(path(), e.to_string()))?;
            each(i, &item)?;
        }
    }
    Ok(())
}

/// The number of items of a sized sequence.
pub fn len(obj: &Bound<'_, PyAny>, path: &dyn Fn() -> String) -> Result<usize, WireError> {
    obj.len().map_err(|_| bad(path, "a sized sequence", obj))
}

/// `obj` if its type is exactly `list`. An exact type check is a pointer compare,
/// where `PyList_Check` is a call into libpython under the stable ABI.
fn exact_list<'a, 'py>(obj: &'a Bound<'py, PyAny>) -> Option<&'a Bound<'py, PyList>> {
    // SAFETY: `obj` is a live object and the GIL is held.
    let is_list = unsafe { ffi::Py_TYPE(obj.as_ptr()) == addr_of_mut!(ffi::PyList_Type) };
    // SAFETY: the type was just checked.
    is_list.then(|| unsafe { obj.cast_unchecked::<PyList>() })
}

/// The value of an exact `int` in 0..2^64; `None` for anything else (the slow
/// path then reports the error). Runs no Python code.
///
/// # Safety
/// `item` is a live object and the GIL is held.
#[inline]
unsafe fn exact_int_u64(item: *mut ffi::PyObject) -> Option<u64> {
    // SAFETY: `item` is live and the GIL is held (this function's contract).
    if unsafe { ffi::Py_TYPE(item) } != addr_of_mut!(ffi::PyLong_Type) {
        return None;
    }
    // SAFETY: as above, and `item` is an exact int: the conversion runs no
    // Python code (no `__index__`), only sets an error on overflow.
    let v = unsafe { ffi::PyLong_AsUnsignedLongLong(item) };
    // SAFETY: the GIL is held; both calls only read or clear this thread's error.
    if v == u64::MAX && !unsafe { ffi::PyErr_Occurred() }.is_null() {
        // SAFETY: as above; the overflow error is ours to clear.
        unsafe { ffi::PyErr_Clear() };
        return None;
    }
    Some(v)
}

/// Reads every item of `list` with `fast` (borrowed, no reference counting),
/// falling back to `slow` (an owned reference) where `fast` gives `None`.
///
/// The borrowed reads are sound because `fast` runs no Python code, so nothing
/// can change the list under them; `slow` may, so each index is re-read and a
/// list that shrank is an error rather than a dangling read.
#[inline]
fn read_list<T>(
    list: &Bound<'_, PyList>,
    out: &mut Vec<T>,
    path: &dyn Fn() -> String,
    fast: impl Fn(*mut ffi::PyObject) -> Option<T>,
    slow: impl Fn(usize, &Bound<'_, PyAny>) -> Result<T, WireError>,
) -> Result<(), WireError> {
    // `PyList_Size` is a call under the stable ABI: read it once, and again
    // only after `slow`, the one place Python code can run.
    let mut len = list.len();
    out.reserve(len);
    let mut i = 0;
    while i < len {
        // SAFETY: the GIL is held and `i < len`, so this is a live borrowed item.
        let item = unsafe { ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t) };
        if item.is_null() {
            return Err(WireError::encode(
                path(),
                "the list changed during encoding",
            ));
        }
        match fast(item) {
            Some(v) => out.push(v),
            None => {
                // SAFETY: `item` is live; the new owned reference keeps it alive.
                let owned = unsafe { Bound::from_borrowed_ptr(list.py(), item) };
                out.push(slow(i, &owned)?);
                len = list.len();
            }
        }
        i += 1;
    }
    Ok(())
}

/// Appends every inner sequence of `outer` to `out` and its end offset to `ends`:
/// the new token ids of a batch. A list of lists of exact ints is read with
/// borrowed references only (no Python code can run there, so nothing can free
/// them); anything else goes through `u32s_into` with owned references.
///
/// A flat sequence of ints instead (a list of ints or an integer buffer such as
/// a 1-D numpy array) gives each of the `n` requests exactly one id: the common
/// decode step, without building a list per request.
pub fn nested_u32s_into(
    outer: &Bound<'_, PyAny>,
    n: usize,
    out: &mut Vec<u32>,
    ends: &mut Vec<usize>,
    path: &dyn Fn() -> String,
) -> Result<(), WireError> {
    if exact_list(outer).is_none() && !outer.is_instance_of::<PyTuple>() {
        if let Some(values) = int_buffer(outer, path)? {
            out.extend(values);
            return one_each(n, out, ends, path);
        }
    }
    if let Some(list) = exact_list(outer) {
        // SAFETY: the GIL is held; index 0 is checked against the length.
        let first_is_int = !list.is_empty()
            && unsafe { ffi::Py_TYPE(ffi::PyList_GetItem(list.as_ptr(), 0)) }
                == addr_of_mut!(ffi::PyLong_Type);
        if first_is_int {
            u32s_into(outer, out, path)?;
            return one_each(n, out, ends, path);
        }
    }
    let Some(outer) = exact_list(outer) else {
        return for_each(outer, path, |i, inner| {
            u32s_into(inner, out, &|| format!("{}[{i}]", path()))?;
            ends.push(out.len());
            Ok(())
        });
    };
    let mut len = outer.len();
    let mut i = 0;
    while i < len {
        // SAFETY: the GIL is held and `i < len`: a live borrowed item.
        let inner = unsafe { ffi::PyList_GetItem(outer.as_ptr(), i as ffi::Py_ssize_t) };
        if inner.is_null() {
            return Err(WireError::encode(
                path(),
                "the list changed during encoding",
            ));
        }
        // SAFETY: `inner` is live; reading it runs no Python code.
        if !unsafe { exact_int_list_into(inner, out) } {
            // SAFETY: `inner` is live; the owned reference keeps it alive while
            // `u32s_into` may run Python code.
            let owned = unsafe { Bound::from_borrowed_ptr(outer.py(), inner) };
            u32s_into(&owned, out, &|| format!("{}[{i}]", path()))?;
            len = outer.len();
        }
        ends.push(out.len());
        i += 1;
    }
    Ok(())
}

/// The flat form: the ids just appended to `out` are one per request; there
/// must be `n` of them (`ends` holds the ends before them).
fn one_each(
    n: usize,
    out: &[u32],
    ends: &mut Vec<usize>,
    path: &dyn Fn() -> String,
) -> Result<(), WireError> {
    let start = ends.last().copied().unwrap_or(0);
    let count = out.len() - start;
    if count != n {
        return Err(WireError::encode(
            path(),
            format!("a flat sequence of {count} ids, expected one per wire id ({n})"),
        ));
    }
    ends.extend(start + 1..=start + n);
    Ok(())
}

/// Appends the items of `obj` if it is an exact list of exact ints in 0..2^32
/// and returns true; otherwise leaves `out` as it was and returns false.
///
/// # Safety
/// `obj` is a live object and the GIL is held.
unsafe fn exact_int_list_into(obj: *mut ffi::PyObject, out: &mut Vec<u32>) -> bool {
    // SAFETY: `obj` is live and the GIL is held (this function's contract).
    if unsafe { ffi::Py_TYPE(obj) } != addr_of_mut!(ffi::PyList_Type) {
        return false;
    }
    let start = out.len();
    // SAFETY: as above, and `obj` was just checked to be a list.
    let n = unsafe { ffi::PyList_Size(obj) };
    out.reserve(n.max(0) as usize);
    for j in 0..n {
        // SAFETY: `j < n` and nothing here runs Python code.
        let item = unsafe { ffi::PyList_GetItem(obj, j) };
        // SAFETY: `item` is a live borrowed item of the list (the list holds it
        // and nothing here runs Python code that could drop it); the GIL is held.
        match unsafe { exact_int_u64(item) }.and_then(|v| u32::try_from(v).ok()) {
            Some(v) => out.push(v),
            None => {
                out.truncate(start);
                return false;
            }
        }
    }
    true
}

/// Appends a sequence of u32 (a list, tuple, buffer of 4- or 8-byte ints, or
/// any iterable of ints) to `out`.
pub fn u32s_into(
    obj: &Bound<'_, PyAny>,
    out: &mut Vec<u32>,
    path: &dyn Fn() -> String,
) -> Result<(), WireError> {
    if let Some(list) = exact_list(obj) {
        return read_list(
            list,
            out,
            path,
            // SAFETY: `read_list` hands over live items with the GIL held.
            |item| unsafe { exact_int_u64(item) }.and_then(|v| u32::try_from(v).ok()),
            |i, item| u32_(item, || format!("{}[{i}]", path())),
        );
    }
    if !obj.is_instance_of::<PyList>() && !obj.is_instance_of::<PyTuple>() {
        if let Some(values) = int_buffer(obj, path)? {
            out.extend(values);
            return Ok(());
        }
    }
    if let Ok(n) = obj.len() {
        out.reserve(n);
    }
    for_each(obj, path, |i, item| {
        out.push(u32_(item, || format!("{}[{i}]", path()))?);
        Ok(())
    })
}

pub fn u32s(obj: &Bound<'_, PyAny>, path: &dyn Fn() -> String) -> Result<Vec<u32>, WireError> {
    let mut out = Vec::new();
    u32s_into(obj, &mut out, path)?;
    Ok(out)
}

pub fn u64s(obj: &Bound<'_, PyAny>, path: &dyn Fn() -> String) -> Result<Vec<u64>, WireError> {
    if let Some(list) = exact_list(obj) {
        let mut out = Vec::new();
        read_list(
            list,
            &mut out,
            path,
            // SAFETY: `read_list` hands over live items with the GIL held.
            |item| unsafe { exact_int_u64(item) },
            |i, item| u64_(item, || format!("{}[{i}]", path())),
        )?;
        return Ok(out);
    }
    if !obj.is_instance_of::<PyList>() && !obj.is_instance_of::<PyTuple>() {
        let copy_err = |e: PyErr| WireError::encode(path(), e.to_string());
        if let Ok(buf) = PyBuffer::<u64>::get(obj) {
            return buf.to_vec(obj.py()).map_err(copy_err);
        }
        if let Ok(buf) = PyBuffer::<i64>::get(obj) {
            let values = buf.to_vec(obj.py()).map_err(copy_err)?;
            return values
                .into_iter()
                .enumerate()
                .map(|(i, v)| {
                    u64::try_from(v).map_err(|_| {
                        WireError::encode(
                            format!("{}[{i}]", path()),
                            format!("{v} is not in 0..2^64"),
                        )
                    })
                })
                .collect();
        }
    }
    let mut out = Vec::with_capacity(obj.len().unwrap_or(0));
    for_each(obj, path, |i, item| {
        out.push(u64_(item, || format!("{}[{i}]", path()))?);
        Ok(())
    })?;
    Ok(out)
}

pub fn f32s(obj: &Bound<'_, PyAny>, path: &dyn Fn() -> String) -> Result<Vec<f32>, WireError> {
    let mut out = Vec::new();
    f32s_into(obj, &mut out, path)?;
    Ok(out)
}

/// Appends a sequence of floats (a list, tuple, float32/float64 buffer or any
/// iterable of floats) to `out`, as f32.
pub fn f32s_into(
    obj: &Bound<'_, PyAny>,
    out: &mut Vec<f32>,
    path: &dyn Fn() -> String,
) -> Result<(), WireError> {
    if let Some(list) = exact_list(obj) {
        return read_list(
            list,
            out,
            path,
            |item| {
                // SAFETY: `read_list` hands over live items with the GIL held.
                let is_float = unsafe { ffi::Py_TYPE(item) == addr_of_mut!(ffi::PyFloat_Type) };
                // SAFETY: as above; an exact float converts without Python code or errors.
                is_float.then(|| unsafe { ffi::PyFloat_AsDouble(item) } as f32)
            },
            |i, item| Ok(f64_(item, || format!("{}[{i}]", path()))? as f32),
        );
    }
    if !obj.is_instance_of::<PyList>() && !obj.is_instance_of::<PyTuple>() {
        let copy_err = |e: PyErr| WireError::encode(path(), e.to_string());
        if let Ok(buf) = PyBuffer::<f32>::get(obj) {
            out.extend(buf.to_vec(obj.py()).map_err(copy_err)?);
            return Ok(());
        }
        if let Ok(buf) = PyBuffer::<f64>::get(obj) {
            let values = buf.to_vec(obj.py()).map_err(copy_err)?;
            out.extend(values.into_iter().map(|v| v as f32));
            return Ok(());
        }
    }
    for_each(obj, path, |i, item| {
        out.push(f64_(item, || format!("{}[{i}]", path()))? as f32);
        Ok(())
    })
}

/// The items of a buffer of 4- or 8-byte integers as u32, range-checked; `None`
/// when `obj` is not such a buffer.
fn int_buffer(
    obj: &Bound<'_, PyAny>,
    path: &dyn Fn() -> String,
) -> Result<Option<Vec<u32>>, WireError> {
    let py = obj.py();
    let copy_err = |e: PyErr| WireError::encode(path(), e.to_string());
    if let Ok(buf) = PyBuffer::<u32>::get(obj) {
        return buf.to_vec(py).map(Some).map_err(copy_err);
    }
    fn narrow<T: Copy + TryInto<u32> + std::fmt::Display>(
        values: Vec<T>,
        path: &dyn Fn() -> String,
    ) -> Result<Option<Vec<u32>>, WireError> {
        values
            .into_iter()
            .enumerate()
            .map(|(i, v)| {
                v.try_into().map_err(|_| {
                    WireError::encode(format!("{}[{i}]", path()), format!("{v} is not in 0..2^32"))
                })
            })
            .collect::<Result<Vec<u32>, WireError>>()
            .map(Some)
    }
    if let Ok(buf) = PyBuffer::<i32>::get(obj) {
        return narrow(buf.to_vec(py).map_err(copy_err)?, path);
    }
    if let Ok(buf) = PyBuffer::<i64>::get(obj) {
        return narrow(buf.to_vec(py).map_err(copy_err)?, path);
    }
    if let Ok(buf) = PyBuffer::<u64>::get(obj) {
        return narrow(buf.to_vec(py).map_err(copy_err)?, path);
    }
    Ok(None)
}
