//! Python binding of the GGUF block kernels (`crate::kernels::gguf`): the blocks
//! come in as a uint8 buffer read in place, `x` (a step's few rows) is copied,
//! and the kernel runs with the GIL released.

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::kernels::{buffer, byte_range, data_ptr};
use crate::error::Error;
use crate::kernels::{self, GgufType, KernelError};

fn qtype(name: &str) -> PyResult<GgufType> {
    GgufType::from_name(name).map_err(|e| Error::from(e).into())
}

/// The elements of a row of `row_bytes` bytes of blocks of `t`, or an error.
fn row_elems(t: GgufType, row_bytes: usize) -> PyResult<usize> {
    let (elems, bytes) = t.block();
    if !row_bytes.is_multiple_of(bytes) {
        return Err(PyValueError::new_err(format!(
            "raw rows of {row_bytes} bytes are not whole {t:?} blocks of {bytes}"
        )));
    }
    Ok(row_bytes / bytes * elems)
}

/// The bytes of a uint8 [rows, row_bytes] buffer, borrowed for the call.
///
/// SAFETY (for the caller): the slice lives as long as `buf` is held, and the
/// caller must keep anything from writing the buffer meanwhile.
pub(super) unsafe fn bytes(buf: &PyBuffer<u8>) -> &[u8] {
    // SAFETY: `buf` is C-contiguous (checked by `buffer`, or by its other caller,
    // `decode_layers::ProjBuf::get`), non-null (`data_ptr`)
    // and valid for reads of `item_count` bytes while held; the caller keeps
    // writers away (see above).
    unsafe { std::slice::from_raw_parts(data_ptr(buf), buf.item_count()) }
}

/// Checks that the float32 output is writable and does not overlap `w`.
fn check_out(out: &PyBuffer<f32>, w: &PyBuffer<u8>) -> PyResult<()> {
    if out.readonly() {
        return Err(PyValueError::new_err("out must be writable"));
    }
    let (o, wr) = (byte_range(out), byte_range(w));
    if o.0 < wr.1 && wr.0 < o.1 {
        return Err(PyValueError::new_err("out must not overlap the blocks"));
    }
    Ok(())
}

/// The output as a slice.
///
/// SAFETY (for the caller): `check_out` passed; the buffer is one the caller has
/// just allocated and shares with no other thread. Then: it is C-contiguous
/// (`buffer` checked), aligned for f32 (pyo3 checked), writable, valid for
/// `item_count` elements while held, and overlaps no operand (the blocks were
/// checked, the rest are copies).
macro_rules! out_slice {
    ($out:expr) => {
        std::slice::from_raw_parts_mut(data_ptr(&$out), $out.item_count())
    };
}

/// `out[rows, k] = dequantize(raw[rows, row_bytes])` for GGUF type `qtype`
/// ("Q4_K", ...), equal to gguf-py's `dequantize` bit for bit; `raw` in the panel
/// layout when `panels`. Private: its one
/// caller (`asyncllm.models.gguf.dequant`) passes a tensor it has just allocated.
#[pyfunction(name = "_gguf_dequantize")]
#[pyo3(signature = (qtype_name, raw, out, panels=false))]
fn gguf_dequantize(
    py: Python<'_>,
    qtype_name: &str,
    raw: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    panels: bool,
) -> PyResult<()> {
    let t = qtype(qtype_name)?;
    let raw = buffer::<u8>(raw, "raw", "uint8", 2)?;
    let out = buffer::<f32>(out, "out", "float32", 2)?;
    let k = out.shape()[1];
    check_out(&out, &raw)?;
    // SAFETY: see `out_slice!`; the sole caller passes a tensor it has just allocated.
    let out = unsafe { out_slice!(out) };
    // SAFETY: the blocks are a model buffer no thread writes during inference.
    let raw = unsafe { bytes(&raw) };
    let decode = if panels {
        kernels::gguf_dequantize_panels
    } else {
        kernels::gguf_dequantize
    };
    py.detach(|| decode(t, k, raw, out))
        .map_err(|e| Error::from(e).into())
}

/// The signature both GGUF matmul kernels share.
type GgufKernel =
    fn(GgufType, usize, usize, &[f32], &[u8], bool, usize, &mut [f32]) -> Result<(), KernelError>;

/// `out = x · dequantize(w)ᵀ` on `kernel`, after checking the buffers.
#[allow(clippy::too_many_arguments)] // the call's operands and its kernel
fn run_gguf_linear(
    py: Python<'_>,
    kernel: GgufKernel,
    qtype_name: &str,
    out: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    w: &Bound<'_, PyAny>,
    panels: bool,
    num_threads: usize,
) -> PyResult<()> {
    let t = qtype(qtype_name)?;
    let x = buffer::<f32>(x, "x", "float32", 2)?;
    let (m, k) = (x.shape()[0], x.shape()[1]);
    let x = x.to_vec(py)?;
    let w = buffer::<u8>(w, "w", "uint8", 2)?;
    let out = buffer::<f32>(out, "out", "float32", 2)?;
    check_out(&out, &w)?;
    // SAFETY: see `out_slice!`; the sole caller passes a tensor it has just allocated.
    let out = unsafe { out_slice!(out) };
    // SAFETY: the blocks are a model weight no thread writes during inference.
    let w = unsafe { bytes(&w) };
    py.detach(|| kernel(t, m, k, &x, w, panels, num_threads, out))
        .map_err(|e| Error::from(e).into())
}

/// `out[m, n] = x[m, k] · dequantize(w)ᵀ` for `w` uint8 [n, row_bytes] blocks of
/// `qtype`: each weight row decoded once per call into a cache-resident buffer;
/// `w` in the panel layout when `panels`. Private: its one caller (`asyncllm.models.gguf.layers`) passes a tensor it
/// has just allocated as `out`, and blocks that no thread writes.
#[pyfunction(name = "_gguf_linear")]
#[pyo3(signature = (qtype_name, out, x, w, num_threads, panels=false))]
fn gguf_linear(
    py: Python<'_>,
    qtype_name: &str,
    out: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    w: &Bound<'_, PyAny>,
    num_threads: usize,
    panels: bool,
) -> PyResult<()> {
    let kernel = kernels::gguf_linear;
    run_gguf_linear(py, kernel, qtype_name, out, x, w, panels, num_threads)
}

/// `out[m, n] = x[m, k] · dequantize(w)ᵀ` as `_gguf_linear`, for the block types
/// (not F32/F16/BF16), with x rounded to int8 per 16 values and integer dot
/// products (rust/kernels/gguf_int.rs); `w` in the panel layout when `panels`
/// (`_gguf_pack_panels`). Private: same one caller, same contract.
#[pyfunction(name = "_gguf_linear_int")]
#[pyo3(signature = (qtype_name, out, x, w, num_threads, panels=false))]
fn gguf_linear_int(
    py: Python<'_>,
    qtype_name: &str,
    out: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    w: &Bound<'_, PyAny>,
    num_threads: usize,
    panels: bool,
) -> PyResult<()> {
    let kernel = kernels::gguf_linear_int;
    run_gguf_linear(py, kernel, qtype_name, out, x, w, panels, num_threads)
}

/// `raw` (uint8 [rows, row_bytes] blocks of `qtype`, a block type) into the
/// panel layout the integer kernel reads fastest (rust/kernels/gguf_panels.rs),
/// in place. Private: its one caller (`asyncllm.models.gguf.layers`) packs a
/// layer's own buffer once, before any kernel reads it.
#[pyfunction(name = "_gguf_pack_panels")]
fn gguf_pack_panels(py: Python<'_>, qtype_name: &str, raw: &Bound<'_, PyAny>) -> PyResult<()> {
    let t = qtype(qtype_name)?;
    let raw = buffer::<u8>(raw, "raw", "uint8", 2)?;
    if raw.readonly() {
        return Err(PyValueError::new_err("raw must be writable"));
    }
    let k = row_elems(t, raw.shape()[1])?;
    // SAFETY: C-contiguous (`buffer`), non-null, writable (checked) and valid for
    // `item_count` bytes while held; the one caller's buffer is read by no
    // other thread until this returns (see above).
    let raw = unsafe { std::slice::from_raw_parts_mut(data_ptr(&raw), raw.item_count()) };
    py.detach(|| kernels::gguf_pack_panels(t, k, raw))
        .map_err(|e| Error::from(e).into())
}

/// Rows `ids` of `raw` (blocks of `qtype` in the panel layout) in the GGUF
/// layout, into `out` (uint8 [len(ids), row_bytes]): for the float paths and the
/// embedding's lookups. Private: `out` is a tensor its caller has just allocated.
#[pyfunction(name = "_gguf_unpack_rows")]
fn gguf_unpack_rows(
    py: Python<'_>,
    qtype_name: &str,
    raw: &Bound<'_, PyAny>,
    ids: Vec<usize>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let t = qtype(qtype_name)?;
    let raw = buffer::<u8>(raw, "raw", "uint8", 2)?;
    let out = buffer::<u8>(out, "out", "uint8", 2)?;
    if out.readonly() {
        return Err(PyValueError::new_err("out must be writable"));
    }
    let (o, r) = (byte_range(&out), byte_range(&raw));
    if o.0 < r.1 && r.0 < o.1 {
        return Err(PyValueError::new_err("out must not overlap raw"));
    }
    let k = row_elems(t, raw.shape()[1])?;
    // SAFETY: C-contiguous (`buffer`), non-null, writable (checked), overlapping
    // nothing read (checked), valid for `item_count` bytes while held, and just
    // allocated by the one caller (see above).
    let out = unsafe { std::slice::from_raw_parts_mut(data_ptr(&out), out.item_count()) };
    // SAFETY: the blocks are a model buffer no thread writes during inference.
    let raw = unsafe { bytes(&raw) };
    py.detach(|| kernels::gguf_unpack_rows(t, k, raw, &ids, out))
        .map_err(|e| Error::from(e).into())
}

/// The path `_gguf_linear_int` runs ("portable", "avx2", "avxvnni",
/// "avx512vnni"), after the cap of `ASYNCLLM_KERNEL_ISA`. Private: tests, benchmarks.
#[pyfunction(name = "_gguf_int_isa")]
fn gguf_int_isa() -> PyResult<&'static str> {
    kernels::gguf_int_isa().map_err(|e| Error::from(e).into())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(gguf_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(gguf_linear, m)?)?;
    m.add_function(wrap_pyfunction!(gguf_linear_int, m)?)?;
    m.add_function(wrap_pyfunction!(gguf_pack_panels, m)?)?;
    m.add_function(wrap_pyfunction!(gguf_unpack_rows, m)?)?;
    m.add_function(wrap_pyfunction!(gguf_int_isa, m)?)
}
