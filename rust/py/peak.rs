//! Python binding of the machine probes (`crate::kernels::peak`) that the
//! roofline benchmark reads: FMA peak and memory read bandwidth.

use pyo3::prelude::*;

use super::kernels::{buffer, data_ptr};
use crate::error::Error;
use crate::kernels;

/// (float operations per second, ISA variant) of `num_threads` threads each
/// running `iters` rounds of independent vector fused multiply-adds. GIL released.
#[pyfunction(name = "_fma_peak")]
fn fma_peak(py: Python<'_>, num_threads: usize, iters: usize) -> PyResult<(f64, &'static str)> {
    py.detach(|| kernels::fma_peak(num_threads, iters))
        .map_err(|e| Error::from(e).into())
}

/// Bytes per second of `num_threads` threads reading disjoint parts of `data`
/// (1-D float32, read in place; pass one far larger than the caches).
#[pyfunction(name = "_read_bandwidth")]
fn read_bandwidth(py: Python<'_>, data: &Bound<'_, PyAny>, num_threads: usize) -> PyResult<f64> {
    let buf = buffer::<f32>(data, "data", "float32", 1)?;
    // SAFETY: `buf` is C-contiguous (checked), aligned and non-null (pyo3 and
    // `data_ptr`), valid for reads of `item_count` elements while the `PyBuffer`
    // is held (all of this function). The values read are only summed: a
    // concurrent write by another thread could change the sum, never the
    // memory's validity, and the caller passes a buffer it owns.
    let data = unsafe { std::slice::from_raw_parts(data_ptr(&buf).cast_const(), buf.item_count()) };
    py.detach(|| kernels::read_bandwidth(data, num_threads))
        .map_err(|e| Error::from(e).into())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(fma_peak, m)?)?;
    m.add_function(wrap_pyfunction!(read_bandwidth, m)?)
}
