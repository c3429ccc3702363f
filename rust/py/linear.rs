//! Python binding of the linear kernel (`crate::kernels::linear`): tensors come in
//! as buffer-protocol objects (`tensor.numpy()`, bf16 as `.view(torch.int16)`),
//! checked with the GIL held; `x` (a few rows) is copied, the weight read in place
//! and the kernel run with the GIL released.

use pyo3::buffer::{Element, PyBuffer, PyUntypedBuffer};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::kernels::{buffer, byte_range, data_ptr};
use crate::error::Error;
use crate::kernels::{self, Elem, LinearShape};

/// A 2-D operand: float32, or bfloat16 as its bits (int16).
pub(super) enum Operand {
    F32(PyBuffer<f32>),
    Bf16(PyBuffer<i16>),
}

impl Operand {
    /// The buffer, typed by its format: one export and no failed attempt on the
    /// per-step path (a decode step makes a few hundred of these calls).
    pub(super) fn get(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        let raw = PyUntypedBuffer::get(obj).map_err(|_| {
            PyValueError::new_err(format!(
                "{name} must support the buffer protocol (pass tensor.numpy())"
            ))
        })?;
        let format = raw.format().to_bytes();
        let op = match format.strip_prefix(b"=").unwrap_or(format) {
            b"f" => raw.into_typed::<f32>().map(Operand::F32),
            b"h" => raw.into_typed::<i16>().map(Operand::Bf16),
            _ => {
                return Err(PyValueError::new_err(format!(
                    "{name} must hold float32 or bfloat16 bits (int16), got buffer format {:?}",
                    String::from_utf8_lossy(format)
                )))
            }
        }
        .map_err(|_| PyValueError::new_err(format!("{name}: unreadable buffer")))?;
        let (ndim, contiguous) = match &op {
            Operand::F32(b) => (b.dimensions(), b.is_c_contiguous()),
            Operand::Bf16(b) => (b.dimensions(), b.is_c_contiguous()),
        };
        if ndim != 2 {
            return Err(PyValueError::new_err(format!(
                "{name} must have 2 dimensions, got {ndim}"
            )));
        }
        if !contiguous {
            return Err(PyValueError::new_err(format!(
                "{name} must be C-contiguous (call .contiguous() on the tensor)"
            )));
        }
        Ok(op)
    }

    pub(super) fn shape(&self) -> &[usize] {
        match self {
            Operand::F32(b) => b.shape(),
            Operand::Bf16(b) => b.shape(),
        }
    }
}

/// `out[m, n] = x[m, k] · w[n, k]ᵀ (+ bias[n])`, every output element in the one
/// reduction order the kernel promises whatever `m` (see rust/kernels/linear.rs).
/// x, w and out share a dtype (float32, or bfloat16 passed as int16 bits); bias
/// is float32. Raises `ValueError`, writing nothing, on any dtype or shape problem.
///
/// Private (`_linear`): its one caller, `asyncllm.models.linear_kernels`, keeps the
/// promises the GIL no longer keeps once released: `out` is a tensor it has just
/// allocated, and no thread writes the weight while the model runs.
#[pyfunction(name = "_linear")]
#[pyo3(signature = (out, x, w, bias, num_threads))]
fn linear(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    w: &Bound<'_, PyAny>,
    bias: Option<&Bound<'_, PyAny>>,
    num_threads: usize,
) -> PyResult<()> {
    let (out, x, w) = (
        Operand::get(out, "out")?,
        Operand::get(x, "x")?,
        Operand::get(w, "w")?,
    );
    let bias = match bias {
        Some(b) => Some(buffer::<f32>(b, "bias", "float32", 1)?.to_vec(py)?),
        None => None,
    };
    let (xs, ws, os) = (x.shape().to_vec(), w.shape().to_vec(), out.shape().to_vec());
    let shape = LinearShape {
        m: xs[0],
        k: xs[1],
        n: ws[0],
    };
    if ws[1] != shape.k || os != [shape.m, shape.n] {
        return Err(PyValueError::new_err(format!(
            "linear needs x [m, k], w [n, k], out [m, n]; got x {xs:?}, w {ws:?}, out {os:?}"
        )));
    }
    match (&out, &x, &w) {
        (Operand::F32(o), Operand::F32(x), Operand::F32(w)) => {
            call::<f32, f32>(py, shape, x.to_vec(py)?, w, bias, num_threads, o)
        }
        (Operand::Bf16(o), Operand::Bf16(x), Operand::Bf16(w)) => {
            let x: Vec<u16> = x.to_vec(py)?.into_iter().map(|v| v as u16).collect();
            call::<u16, i16>(py, shape, x, w, bias, num_threads, o)
        }
        _ => Err(PyValueError::new_err(
            "out, x and w must share a dtype: all float32, or all bfloat16 (int16 bits)",
        )),
    }
}

/// Runs the kernel for elements `E` (f32, or bf16 bits read through buffers of
/// `B`: i16, which has u16's size, alignment and bits).
fn call<E: Elem, B: Element>(
    py: Python<'_>,
    shape: LinearShape,
    x: Vec<E>,
    w: &PyBuffer<B>,
    bias: Option<Vec<f32>>,
    num_threads: usize,
    out: &PyBuffer<B>,
) -> PyResult<()> {
    if out.readonly() {
        return Err(PyValueError::new_err("out must be writable"));
    }
    let (o, wr) = (byte_range(out), byte_range(w));
    if o.0 < wr.1 && wr.0 < o.1 {
        return Err(PyValueError::new_err("out must not overlap w"));
    }
    // SAFETY: `w` is C-contiguous (checked by `buffer`), its pointer aligned for
    // `B` (pyo3 checked) and so for `E` (same size and alignment: f32 for f32,
    // u16 for i16), non-null (`data_ptr`), valid for reads of `item_count`
    // elements while the `PyBuffer` is held (all of this function). Nothing
    // writes it meanwhile: the exporter cannot resize it with an export
    // outstanding, `out` was checked not to overlap it, and the sole caller
    // passes a model weight, which no thread writes during inference.
    let w = unsafe { std::slice::from_raw_parts(data_ptr(w).cast::<E>(), w.item_count()) };
    // SAFETY: `out` is C-contiguous, aligned as above, writable (checked) and
    // valid for its `item_count` elements while held; it overlaps `w` (checked)
    // and no other operand (the rest are copies); the sole caller passes a
    // tensor it has just allocated and shares with no other thread.
    let out =
        unsafe { std::slice::from_raw_parts_mut(data_ptr(out).cast::<E>(), out.item_count()) };
    py.detach(|| kernels::linear(shape, &x, w, bias.as_deref(), num_threads, out))
        .map_err(|e| Error::from(e).into())
}

/// The instruction-set variant `_linear` runs here: "portable", "avx2" or
/// "avx512", after the cap of `ASYNCLLM_KERNEL_ISA`. Private: tests, benchmarks.
#[pyfunction(name = "_linear_isa")]
fn linear_isa() -> PyResult<&'static str> {
    kernels::linear_isa().map_err(|e| Error::from(e).into())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(linear, m)?)?;
    m.add_function(wrap_pyfunction!(linear_isa, m)?)
}
