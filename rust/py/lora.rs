//! Python binding of LoRA's shrink + expand (`crate::kernels::lora_add`): the
//! operands come in as buffers (float32, or bfloat16 as int16 bits), are checked
//! with the GIL held, and the kernel adds into `y` with the GIL released.

use pyo3::buffer::{Element, PyBuffer};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::kernels::{buffer, byte_range, data_ptr};
use super::linear::Operand;
use crate::error::Error;
use crate::kernels::{self, Elem, LoraLayout, LoraShape};

/// `y[t] += (x[t] · A[s]) · B[s]` for each token `t` whose `token_slot[t] = s` is
/// not -1. `y` [t, n], `x` [t, k], `a` [slots * k, width] (each slot's [k, width]
/// stacked), `b` [slots * width, n], `token_slot` int64 [t]; y, x, a and b share
/// a dtype; `parts`: the output sizes of the fused projections (B block-diagonal,
/// read only within its blocks); `ranks` int64 [slots]: each slot's rank in this
/// layer (the padded columns beyond it are never read). Raises `ValueError`, writing nothing, on any
/// dtype, shape, part or slot problem.
///
/// Private (`_lora_add`): its one caller, `asyncllm.lora.kernel`, keeps the
/// promises the GIL no longer keeps once released: `y` is the base layer's output,
/// just allocated and shared with no other thread, and nothing writes x, a or b
/// while the model runs.
#[pyfunction(name = "_lora_add")]
#[pyo3(signature = (y, x, a, b, token_slot, parts, ranks, num_threads))]
#[allow(clippy::too_many_arguments)]
fn lora_add(
    py: Python<'_>,
    y: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    a: &Bound<'_, PyAny>,
    b: &Bound<'_, PyAny>,
    token_slot: &Bound<'_, PyAny>,
    parts: Vec<usize>,
    ranks: &Bound<'_, PyAny>,
    num_threads: usize,
) -> PyResult<()> {
    let (y, x, a, b) = (
        Operand::get(y, "y")?,
        Operand::get(x, "x")?,
        Operand::get(a, "a")?,
        Operand::get(b, "b")?,
    );
    let slots = buffer::<i64>(token_slot, "token_slot", "int64", 1)?.to_vec(py)?;
    let ranks = buffer::<i64>(ranks, "ranks", "int64", 1)?.to_vec(py)?;
    let ranks = ranks
        .into_iter()
        .map(usize::try_from)
        .collect::<Result<Vec<usize>, _>>()
        .map_err(|_| PyValueError::new_err("lora_add: a negative rank"))?;
    let (ys, xs, as_, bs) = (y.shape(), x.shape(), a.shape(), b.shape());
    let (k, width) = (xs[1], as_[1]);
    if k == 0 || width == 0 || as_[0] % k != 0 || bs[0] != as_[0] / k * width {
        return Err(PyValueError::new_err(format!(
            "lora_add needs a [slots * k, width] and b [slots * width, n] for x [t, k]; got x \
             {xs:?}, a {as_:?}, b {bs:?}"
        )));
    }
    let shape = LoraShape {
        tokens: xs[0],
        k,
        width,
        n: ys[1],
        slots: as_[0] / k,
    };
    let layout = LoraLayout {
        parts: &parts,
        ranks: &ranks,
    };
    match (&y, &x, &a, &b) {
        (Operand::F32(y), Operand::F32(x), Operand::F32(a), Operand::F32(b)) => {
            call::<f32, f32>(py, shape, layout, y, x, a, b, &slots, num_threads)
        }
        (Operand::Bf16(y), Operand::Bf16(x), Operand::Bf16(a), Operand::Bf16(b)) => {
            call::<u16, i16>(py, shape, layout, y, x, a, b, &slots, num_threads)
        }
        _ => Err(PyValueError::new_err(
            "y, x, a and b must share a dtype: all float32, or all bfloat16 (int16 bits)",
        )),
    }
}

/// Runs the kernel for elements `E` read through buffers of `B` (f32 for f32;
/// i16 for bf16 bits as u16: same size, alignment and bits).
#[allow(clippy::too_many_arguments)]
fn call<E: Elem, B: Element>(
    py: Python<'_>,
    shape: LoraShape,
    layout: LoraLayout<'_>,
    y: &PyBuffer<B>,
    x: &PyBuffer<B>,
    a: &PyBuffer<B>,
    b: &PyBuffer<B>,
    token_slot: &[i64],
    num_threads: usize,
) -> PyResult<()> {
    if y.readonly() {
        return Err(PyValueError::new_err("y must be writable"));
    }
    let yr = byte_range(y);
    for (name, other) in [("x", x), ("a", a), ("b", b)] {
        let r = byte_range(other);
        if yr.0 < r.1 && r.0 < yr.1 {
            return Err(PyValueError::new_err(format!("y must not overlap {name}")));
        }
    }
    // SAFETY: x, a and b are C-contiguous (checked by `Operand::get`), aligned for
    // `B` (pyo3 checked) and so for `E`, non-null (`data_ptr`) and valid for reads
    // of `item_count` elements while their `PyBuffer`s are held (all of this
    // function). Nothing writes them meanwhile: `y` was checked not to overlap
    // them, and the sole caller passes a layer's input and its adapter slots,
    // which no thread writes during the forward.
    let (x, a, b) = unsafe {
        (
            std::slice::from_raw_parts(data_ptr(x).cast::<E>(), x.item_count()),
            std::slice::from_raw_parts(data_ptr(a).cast::<E>(), a.item_count()),
            std::slice::from_raw_parts(data_ptr(b).cast::<E>(), b.item_count()),
        )
    };
    // SAFETY: `y` is C-contiguous, aligned as above, writable (checked) and valid
    // for its `item_count` elements while held; it overlaps no other operand
    // (checked; `token_slot` is a copy), and the sole caller passes the base
    // layer's fresh output, shared with no other thread.
    let y = unsafe { std::slice::from_raw_parts_mut(data_ptr(y).cast::<E>(), y.item_count()) };
    py.detach(|| kernels::lora_add(shape, layout, y, x, a, b, token_slot, num_threads))
        .map_err(|e| Error::from(e).into())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(lora_add, m)?)
}
