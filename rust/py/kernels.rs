//! Python binding of the CPU kernels (`crate::kernels`). Tensors come in as
//! buffer-protocol objects (`tensor.numpy()`, zero-copy for CPU tensors): their
//! dtypes, shapes and contiguity are checked with the GIL held, then the kernel
//! runs on the borrowed memory with the GIL released.

use pyo3::buffer::{Element, PyBuffer, PyUntypedBuffer};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::error::Error;
use crate::kernels::{self, BlockIndex, DecodeShape};

/// A C-contiguous buffer of `ndim` dimensions holding `T`, or a `ValueError`
/// naming the argument.
fn buffer<T: Element>(
    obj: &Bound<'_, PyAny>,
    name: &str,
    dtype: &str,
    ndim: usize,
) -> PyResult<PyBuffer<T>> {
    let raw = PyUntypedBuffer::get(obj).map_err(|_| {
        PyValueError::new_err(format!(
            "{name} must support the buffer protocol (pass tensor.numpy())"
        ))
    })?;
    let format = raw.format().to_string_lossy().into_owned();
    let buf = raw.into_typed::<T>().map_err(|_| {
        PyValueError::new_err(format!(
            "{name} must hold {dtype}, got buffer format {format:?}"
        ))
    })?;
    if buf.dimensions() != ndim {
        return Err(PyValueError::new_err(format!(
            "{name} must have {ndim} dimensions, got shape {:?}",
            buf.shape()
        )));
    }
    if !buf.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "{name} must be C-contiguous (call .contiguous() on the tensor)"
        )));
    }
    Ok(buf)
}

/// Block tables and sequence lengths: int64 (torch's index type) or int32.
enum Ints {
    I32(PyBuffer<i32>),
    I64(PyBuffer<i64>),
}

impl Ints {
    fn get(obj: &Bound<'_, PyAny>, name: &str, ndim: usize) -> PyResult<Self> {
        match buffer::<i64>(obj, name, "int64 or int32", ndim) {
            Ok(buf) => Ok(Ints::I64(buf)),
            Err(err) => match buffer::<i32>(obj, name, "int32", ndim) {
                Ok(buf) => Ok(Ints::I32(buf)),
                Err(_) => Err(err),
            },
        }
    }

    fn shape(&self) -> &[usize] {
        match self {
            Ints::I32(buf) => buf.shape(),
            Ints::I64(buf) => buf.shape(),
        }
    }

    fn bytes(&self) -> (usize, usize) {
        match self {
            Ints::I32(buf) => byte_range(buf),
            Ints::I64(buf) => byte_range(buf),
        }
    }
}

fn byte_range<T: Element>(buf: &PyBuffer<T>) -> (usize, usize) {
    let start = buf.buf_ptr() as usize;
    (start, start + buf.len_bytes())
}

/// The buffer's elements. SAFETY: the caller keeps `buf` alive while the slice
/// is used and must not hand out a mutable slice of the same memory.
unsafe fn slice<T: Element>(buf: &PyBuffer<T>) -> &[T] {
    // `buffer` checked contiguity, so the pointer is there.
    buf.as_slice_ptr()
        .map_or(&[], |ptr| unsafe { ptr.as_ref() })
}

/// Decode attention for `num_seqs` sequences of one query token each, reading
/// K/V in place through block tables (see `crate::kernels::paged_attention`).
/// Writes `out` `[num_seqs, num_heads * head_dim]` f32 from q
/// `[num_seqs, num_heads, head_dim]` f32, kv_cache
/// `[2, num_blocks, block_size, num_kv_heads, head_dim]` f32, block_tables
/// `[num_seqs, blocks_per_seq]` and seq_lens `[num_seqs]` (int64 or int32).
/// Raises `ValueError`, writing nothing, on any dtype, shape, contiguity or
/// range problem. The GIL is released while it computes: other threads must
/// not write to these buffers meanwhile.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // the kernel's operands, all distinct
fn paged_decode_attention(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    q: &Bound<'_, PyAny>,
    kv_cache: &Bound<'_, PyAny>,
    block_tables: &Bound<'_, PyAny>,
    seq_lens: &Bound<'_, PyAny>,
    scale: f32,
    num_threads: usize,
) -> PyResult<()> {
    let out = buffer::<f32>(out, "out", "float32", 2)?;
    let q = buffer::<f32>(q, "q", "float32", 3)?;
    let kv_cache = buffer::<f32>(kv_cache, "kv_cache", "float32", 5)?;
    let tables = Ints::get(block_tables, "block_tables", 2)?;
    let lens = Ints::get(seq_lens, "seq_lens", 1)?;
    if out.readonly() {
        return Err(PyValueError::new_err("out must be writable"));
    }
    let (qs, cs, ts) = (q.shape(), kv_cache.shape(), tables.shape());
    let shape = DecodeShape {
        num_seqs: qs[0],
        num_heads: qs[1],
        num_kv_heads: cs[3],
        head_dim: qs[2],
        num_blocks: cs[1],
        block_size: cs[2],
        blocks_per_seq: ts[1],
    };
    let mismatch = |what: &str| {
        PyValueError::new_err(format!(
            "{what}: out {:?}, q {qs:?}, kv_cache {cs:?}, block_tables {ts:?}, seq_lens {:?}",
            out.shape(),
            lens.shape()
        ))
    };
    if cs[0] != 2 || cs[4] != shape.head_dim {
        return Err(mismatch(
            "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim]",
        ));
    }
    if ts[0] != shape.num_seqs || lens.shape()[0] != shape.num_seqs {
        return Err(mismatch(
            "block_tables and seq_lens must have a row per sequence of q",
        ));
    }
    if out.shape() != [shape.num_seqs, shape.num_heads * shape.head_dim] {
        return Err(mismatch("out must be [num_seqs, num_heads * head_dim]"));
    }
    let written = byte_range(&out);
    let read = [
        byte_range(&q),
        byte_range(&kv_cache),
        tables.bytes(),
        lens.bytes(),
    ];
    if read.iter().any(|r| r.0 < written.1 && written.0 < r.1) {
        return Err(PyValueError::new_err("out must not overlap the inputs"));
    }
    // SAFETY: the buffers stay alive (and their exporters cannot resize them)
    // until this function returns; `out` is writable and overlaps nothing else.
    let (q, kv) = unsafe { (slice(&q), slice(&kv_cache)) };
    let mut out_ptr = out
        .as_slice_ptr()
        .ok_or_else(|| PyValueError::new_err("out must be C-contiguous"))?;
    let out = unsafe { out_ptr.as_mut() };
    let result = match (&tables, &lens) {
        (Ints::I64(t), Ints::I64(l)) => run(py, &shape, q, kv, t, l, scale, num_threads, out),
        (Ints::I64(t), Ints::I32(l)) => run(py, &shape, q, kv, t, l, scale, num_threads, out),
        (Ints::I32(t), Ints::I64(l)) => run(py, &shape, q, kv, t, l, scale, num_threads, out),
        (Ints::I32(t), Ints::I32(l)) => run(py, &shape, q, kv, t, l, scale, num_threads, out),
    };
    result.map_err(|e| Error::from(e).into())
}

#[allow(clippy::too_many_arguments)]
fn run<T: BlockIndex + Element, L: BlockIndex + Element>(
    py: Python<'_>,
    shape: &DecodeShape,
    q: &[f32],
    kv_cache: &[f32],
    tables: &PyBuffer<T>,
    lens: &PyBuffer<L>,
    scale: f32,
    num_threads: usize,
    out: &mut [f32],
) -> Result<(), kernels::KernelError> {
    // SAFETY: as for q and kv_cache in the caller.
    let (tables, lens) = unsafe { (slice(tables), slice(lens)) };
    py.detach(|| {
        kernels::paged_decode_attention(shape, q, kv_cache, tables, lens, scale, num_threads, out)
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(paged_decode_attention, m)?)
}
