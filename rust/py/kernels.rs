//! Python binding of the CPU kernels (`crate::kernels`). Tensors come in as
//! buffer-protocol objects (`tensor.numpy()`, zero-copy for CPU tensors): their
//! dtypes, shapes and contiguity are checked with the GIL held, the small
//! operands copied, then the kernel runs with the GIL released, reading the KV
//! cache in place through a raw pointer (`kernels::KvCache`).

use pyo3::buffer::{Element, PyBuffer, PyUntypedBuffer};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::error::Error;
use crate::kernels::{self, BlockIndex, DecodeShape, KvCache, KvElem};

/// A C-contiguous buffer of `ndim` dimensions holding `T`, or a `ValueError`
/// naming the argument.
pub(super) fn buffer<T: Element>(
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

/// Block tables and sequence lengths, copied out of their buffers: int64
/// (torch's index type) or int32.
enum Ints {
    I32(Vec<i32>),
    I64(Vec<i64>),
}

impl Ints {
    /// The buffer's shape and a copy of its elements, or a `ValueError`.
    fn copy(
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        name: &str,
        ndim: usize,
    ) -> PyResult<(Vec<usize>, Self)> {
        match buffer::<i64>(obj, name, "int64 or int32", ndim) {
            Ok(buf) => Ok((buf.shape().to_vec(), Ints::I64(buf.to_vec(py)?))),
            Err(err) => match buffer::<i32>(obj, name, "int32", ndim) {
                Ok(buf) => Ok((buf.shape().to_vec(), Ints::I32(buf.to_vec(py)?))),
                Err(_) => Err(err),
            },
        }
    }
}

/// The buffer's first element, or a dangling (aligned, non-null) pointer when
/// it has none: a zero-length buffer may report a null address, which neither
/// `from_raw_parts_mut` nor `KvCache::from_raw` accepts. A non-empty buffer's
/// address is never null.
pub(super) fn data_ptr<T: Element>(buf: &PyBuffer<T>) -> *mut T {
    if buf.item_count() == 0 {
        std::ptr::NonNull::dangling().as_ptr()
    } else {
        buf.buf_ptr().cast()
    }
}

pub(super) fn byte_range<T: Element>(buf: &PyBuffer<T>) -> (usize, usize) {
    let start = buf.buf_ptr() as usize;
    (start, start + buf.len_bytes())
}

/// A KV cache buffer: float32, or bfloat16 passed as its bits
/// (`tensor.view(torch.int16).numpy()`: numpy has no bfloat16).
enum Cache {
    F32(PyBuffer<f32>),
    Bf16(PyBuffer<i16>),
}

impl Cache {
    fn get(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        match buffer::<f32>(obj, "kv_cache", "float32 or bfloat16 bits (int16)", 5) {
            Ok(buf) => Ok(Cache::F32(buf)),
            Err(err) => match buffer::<i16>(obj, "kv_cache", "int16", 5) {
                Ok(buf) => Ok(Cache::Bf16(buf)),
                Err(_) => Err(err),
            },
        }
    }

    fn shape(&self) -> &[usize] {
        match self {
            Cache::F32(b) => b.shape(),
            Cache::Bf16(b) => b.shape(),
        }
    }

    fn byte_range(&self) -> (usize, usize) {
        match self {
            Cache::F32(b) => byte_range(b),
            Cache::Bf16(b) => byte_range(b),
        }
    }
}

/// Decode attention for `num_seqs` sequences of one query token each, reading
/// K/V in place through block tables (see `crate::kernels::paged_attention`).
/// Writes `out` `[num_seqs, num_heads * head_dim]` f32 from q
/// `[num_seqs, num_heads, head_dim]` f32, kv_cache
/// `[2, num_blocks, block_size, num_kv_heads, head_dim]` f32 or bf16 (as int16
/// bits; q then holds bf16 values widened to f32), block_tables
/// `[num_seqs, blocks_per_seq]` and seq_lens `[num_seqs]` (int64 or int32).
/// Raises `ValueError`, writing nothing, on any dtype, shape, contiguity or
/// range problem.
///
/// Private to the package (`_paged_decode_attention`): its one caller,
/// `asyncllm.models.attention._native_decode`, keeps the promise the GIL can
/// no longer keep once it is released for the computation: no other thread
/// writes `kv_cache` or touches `out` meanwhile. q, the block tables and the
/// lengths are small and copied first, so they need no such promise, and the
/// block ids the kernel checks are the ones it uses.
/// `window` > 0: each sequence attends to its last `window` tokens only
/// (sliding-window layers); 0: to all of them.
#[pyfunction(name = "_paged_decode_attention")]
#[pyo3(signature = (out, q, kv_cache, block_tables, seq_lens, scale, num_threads, window=0))]
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
    window: usize,
) -> PyResult<()> {
    let out = buffer::<f32>(out, "out", "float32", 2)?;
    let q = buffer::<f32>(q, "q", "float32", 3)?;
    let kv_cache = Cache::get(kv_cache)?;
    let (ts, tables) = Ints::copy(py, block_tables, "block_tables", 2)?;
    let (ls, lens) = Ints::copy(py, seq_lens, "seq_lens", 1)?;
    if out.readonly() {
        return Err(PyValueError::new_err("out must be writable"));
    }
    let (qs, cs) = (q.shape(), kv_cache.shape());
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
            "{what}: out {:?}, q {qs:?}, kv_cache {cs:?}, block_tables {ts:?}, seq_lens {ls:?}",
            out.shape(),
        ))
    };
    if cs[0] != 2 || cs[4] != shape.head_dim {
        return Err(mismatch(
            "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim]",
        ));
    }
    if ts[0] != shape.num_seqs || ls[0] != shape.num_seqs {
        return Err(mismatch(
            "block_tables and seq_lens must have a row per sequence of q",
        ));
    }
    if out.shape() != [shape.num_seqs, shape.num_heads * shape.head_dim] {
        return Err(mismatch("out must be [num_seqs, num_heads * head_dim]"));
    }
    let written = byte_range(&out);
    let cache = kv_cache.byte_range();
    if cache.0 < written.1 && written.0 < cache.1 {
        return Err(PyValueError::new_err("out must not overlap kv_cache"));
    }
    let q = q.to_vec(py)?;
    // SAFETY: `out` is C-contiguous, aligned (pyo3 checked), writable (checked
    // above) and valid for its `item_count` elements while the `PyBuffer` is
    // held, i.e. for all of this function; it overlaps no other operand (the
    // rest are copies, and `kv_cache` was checked). It is exclusively ours for
    // the call: the sole caller passes a tensor it has just allocated and
    // shares with no other thread.
    let out = unsafe { std::slice::from_raw_parts_mut(data_ptr(&out), out.item_count()) };
    let result = match &kv_cache {
        Cache::F32(buf) => {
            // SAFETY: `buf` is a C-contiguous (checked by `buffer`) f32 buffer
            // whose pointer pyo3 checked to be aligned (non-null: `data_ptr`),
            // valid for reads of its `item_count` elements while the `PyBuffer`
            // is held: until this function returns, which outlives every use of
            // `kv`. No one writes it meanwhile: the exporter cannot resize a
            // buffer with an export outstanding, `out` (the only memory written
            // here) was checked not to overlap it, and the sole caller (see
            // above) runs the model on the thread that alone writes the cache,
            // which is blocked in this call.
            let kv = unsafe { KvCache::from_raw(data_ptr(buf), buf.item_count()) };
            dispatch(
                py,
                &shape,
                &q,
                kv,
                &tables,
                &lens,
                (scale, window, num_threads),
                out,
            )
        }
        Cache::Bf16(buf) => {
            // SAFETY: as for f32 above, for an int16 buffer; the pointer is cast
            // to u16, which has i16's size and alignment and reads the same bits.
            let kv = unsafe {
                KvCache::<u16>::from_raw(data_ptr(buf).cast_const().cast(), buf.item_count())
            };
            dispatch(
                py,
                &shape,
                &q,
                kv,
                &tables,
                &lens,
                (scale, window, num_threads),
                out,
            )
        }
    };
    result.map_err(|e| Error::from(e).into())
}

/// `run` for the block-table and length types the caller passed.
#[allow(clippy::too_many_arguments)]
fn dispatch<E: KvElem>(
    py: Python<'_>,
    shape: &DecodeShape,
    q: &[f32],
    kv: KvCache<'_, E>,
    tables: &Ints,
    lens: &Ints,
    w: (f32, usize, usize),
    out: &mut [f32],
) -> Result<(), kernels::KernelError> {
    match (tables, lens) {
        (Ints::I64(t), Ints::I64(l)) => run(py, shape, q, kv, t, l, w, out),
        (Ints::I64(t), Ints::I32(l)) => run(py, shape, q, kv, t, l, w, out),
        (Ints::I32(t), Ints::I64(l)) => run(py, shape, q, kv, t, l, w, out),
        (Ints::I32(t), Ints::I32(l)) => run(py, shape, q, kv, t, l, w, out),
    }
}

#[allow(clippy::too_many_arguments)]
fn run<T: BlockIndex, L: BlockIndex, E: KvElem>(
    py: Python<'_>,
    shape: &DecodeShape,
    q: &[f32],
    kv_cache: KvCache<'_, E>,
    tables: &[T],
    lens: &[L],
    (scale, window, num_threads): (f32, usize, usize),
    out: &mut [f32],
) -> Result<(), kernels::KernelError> {
    py.detach(|| {
        kernels::paged_decode_attention_windowed(
            shape,
            q,
            kv_cache,
            tables,
            lens,
            scale,
            window,
            num_threads,
            out,
        )
    })
}

/// The instruction-set variant `_paged_decode_attention` runs here for a cache
/// of `dtype` ("float32" or "bfloat16"): "portable", "avx2" or "avx512bf16",
/// after the cap of `ASYNCLLM_KERNEL_ISA`. Private: for tests and benchmarks.
#[pyfunction(name = "_kernel_isa")]
fn kernel_isa(dtype: &str) -> PyResult<&'static str> {
    let isa = match dtype {
        "float32" => kernels::kernel_isa::<f32>(),
        "bfloat16" => kernels::kernel_isa::<u16>(),
        _ => {
            return Err(PyValueError::new_err(format!(
                "dtype must be \"float32\" or \"bfloat16\", got {dtype:?}"
            )))
        }
    };
    isa.map_err(|e| Error::from(e).into())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(paged_decode_attention, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_isa, m)?)
}
