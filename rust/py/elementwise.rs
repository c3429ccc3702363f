//! Python binding of the row-wise RMSNorm, SiLU × up and rotary kernels
//! (`crate::kernels::elementwise`, `silu_mul`, `rotary`):
//! float32, or bfloat16 passed as int16 bits; inputs read in place, the output
//! (and the residual, updated in place) written with the GIL released.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::decode_bufs::Buf;
use crate::error::Error;
use crate::kernels;

/// The buffers of one call, checked: one dtype for all, `written` writable and
/// apart from every other.
fn buffers<const N: usize>(
    objs: [(&Bound<'_, PyAny>, &str); N],
    written: &[usize],
) -> PyResult<[Buf; N]> {
    let bufs: Vec<Buf> = objs
        .iter()
        .map(|(o, n)| Buf::get(o, n))
        .collect::<PyResult<_>>()?;
    if bufs.iter().any(|b| b.is_bf16() != bufs[0].is_bf16()) {
        return Err(PyValueError::new_err(
            "every buffer must share one dtype: float32, or bfloat16 bits (int16)",
        ));
    }
    for &w in written {
        if bufs[w].readonly() {
            return Err(PyValueError::new_err(format!(
                "{} must be writable",
                objs[w].1
            )));
        }
        let (a, b) = bufs[w].bytes();
        for (i, other) in bufs.iter().enumerate() {
            let (c, d) = other.bytes();
            if i != w && a < d && c < b {
                return Err(PyValueError::new_err(format!(
                    "{} must not overlap {}",
                    objs[w].1, objs[i].1
                )));
            }
        }
    }
    Ok(bufs
        .try_into()
        .unwrap_or_else(|_| unreachable!("N buffers from N objects")))
}

/// # Safety
/// `E` matches the buffer's dtype (u16 for bf16 bits), and nothing else reads or
/// writes it while the slice lives: `buffers` checked it writable and apart from
/// the call's other buffers, and the sole caller (asyncllm.models.native_ops)
/// passes tensors no other thread touches during the step, the outputs fresh.
// The memory is the exporter's, not the `Buf`'s: the handle is only borrowed to
// reach it; exclusivity is the caller's promise above.
#[allow(clippy::mut_from_ref)]
unsafe fn slice_mut<E>(buf: &Buf) -> &mut [E] {
    // SAFETY: the caller's.
    unsafe { std::slice::from_raw_parts_mut(buf.ptr_mut::<E>(), buf.len()) }
}

/// `out = rms_norm(x) * weight`, row by row (rows of `len(weight)`).
#[pyfunction(name = "_rms_norm")]
fn rms_norm(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    eps: f32,
    num_threads: usize,
) -> PyResult<()> {
    let [out, x, weight] = buffers([(out, "out"), (x, "x"), (weight, "weight")], &[0])?;
    let result = if x.is_bf16() {
        // SAFETY: as `slice_mut`'s (the buffers checked by `buffers`).
        let (o, x, w) = unsafe {
            (
                slice_mut::<u16>(&out),
                x.slice::<u16>(),
                weight.slice::<u16>(),
            )
        };
        py.detach(|| kernels::rms_norm(x, w, eps, o, num_threads))
    } else {
        // SAFETY: as above.
        let (o, x, w) = unsafe {
            (
                slice_mut::<f32>(&out),
                x.slice::<f32>(),
                weight.slice::<f32>(),
            )
        };
        py.detach(|| kernels::rms_norm(x, w, eps, o, num_threads))
    };
    result.map_err(|e| Error::from(e).into())
}

/// `residual += x`, then `out = rms_norm(residual) * weight`, row by row.
#[pyfunction(name = "_add_rms_norm")]
fn add_rms_norm(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    residual: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    eps: f32,
    num_threads: usize,
) -> PyResult<()> {
    let [out, res, x, weight] = buffers(
        [
            (out, "out"),
            (residual, "residual"),
            (x, "x"),
            (weight, "weight"),
        ],
        &[0, 1],
    )?;
    let result = if x.is_bf16() {
        // SAFETY: the buffers are C-contiguous, aligned, non-null and valid while
        // their exports are held (this call); the written ones are writable and
        // overlap no other (`buffers`); the sole caller (asyncllm.models.native_ops)
        // passes tensors no other thread touches during the step, the outputs fresh.
        let (o, r, x, w) = unsafe {
            (
                slice_mut::<u16>(&out),
                slice_mut::<u16>(&res),
                x.slice::<u16>(),
                weight.slice::<u16>(),
            )
        };
        py.detach(|| kernels::add_rms_norm(x, r, w, eps, o, num_threads))
    } else {
        // SAFETY: the buffers are C-contiguous, aligned, non-null and valid while
        // their exports are held (this call); the written ones are writable and
        // overlap no other (`buffers`); the sole caller (asyncllm.models.native_ops)
        // passes tensors no other thread touches during the step, the outputs fresh.
        let (o, r, x, w) = unsafe {
            (
                slice_mut::<f32>(&out),
                slice_mut::<f32>(&res),
                x.slice::<f32>(),
                weight.slice::<f32>(),
            )
        };
        py.detach(|| kernels::add_rms_norm(x, r, w, eps, o, num_threads))
    };
    result.map_err(|e| Error::from(e).into())
}

/// `out = silu(gate) * up`, row by row: each row of `gate_up` holds a row's gate
/// (`inter` elements) then its up.
#[pyfunction(name = "_silu_mul")]
fn silu_mul(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    gate_up: &Bound<'_, PyAny>,
    inter: usize,
    num_threads: usize,
) -> PyResult<()> {
    let [out, gate_up] = buffers([(out, "out"), (gate_up, "gate_up")], &[0])?;
    let result = if out.is_bf16() {
        // SAFETY: as `slice_mut`'s (the buffers checked by `buffers`).
        let (o, g) = unsafe { (slice_mut::<u16>(&out), gate_up.slice::<u16>()) };
        py.detach(|| kernels::silu_mul(g, o, inter, num_threads))
    } else {
        // SAFETY: as above.
        let (o, g) = unsafe { (slice_mut::<f32>(&out), gate_up.slice::<f32>()) };
        py.detach(|| kernels::silu_mul(g, o, inter, num_threads))
    };
    result.map_err(|e| Error::from(e).into())
}

/// `out[t, h] = rotate_half(x[t, h])` by `cos[t]`, `sin[t]` for the first
/// `heads` heads of each row of `x` (rows of `len(x) / T`, T = rows of cos).
#[pyfunction(name = "_rotary")]
#[allow(clippy::too_many_arguments)] // the op's operands, all distinct
fn rotary(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    cos: &Bound<'_, PyAny>,
    sin: &Bound<'_, PyAny>,
    heads: usize,
    head_dim: usize,
    num_threads: usize,
) -> PyResult<()> {
    let [out, x, cos, sin] = buffers([(out, "out"), (x, "x"), (cos, "cos"), (sin, "sin")], &[0])?;
    let rows = cos.len() / (head_dim / 2).max(1);
    let shape = kernels::RotaryShape {
        row_len: x.len().checked_div(rows).unwrap_or(0),
        heads,
        head_dim,
    };
    let result = if out.is_bf16() {
        // SAFETY: as `slice_mut`'s (the buffers checked by `buffers`).
        let (o, x, c, s) = unsafe {
            (
                slice_mut::<u16>(&out),
                x.slice::<u16>(),
                cos.slice::<u16>(),
                sin.slice::<u16>(),
            )
        };
        py.detach(|| kernels::rotary(shape, x, c, s, o, num_threads))
    } else {
        // SAFETY: as above.
        let (o, x, c, s) = unsafe {
            (
                slice_mut::<f32>(&out),
                x.slice::<f32>(),
                cos.slice::<f32>(),
                sin.slice::<f32>(),
            )
        };
        py.detach(|| kernels::rotary(shape, x, c, s, o, num_threads))
    };
    result.map_err(|e| Error::from(e).into())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(rotary, m)?)?;
    m.add_function(wrap_pyfunction!(rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(add_rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(silu_mul, m)?)
}
